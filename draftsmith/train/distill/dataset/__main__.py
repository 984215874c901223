"""`python -m draftsmith.train.distill.dataset ...` (the same job as `draftsmith generate`)."""
import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # torch is not loaded yet; see train.cli

from draftsmith.train.distill.dataset.job import main  # noqa: E402

main()
