"""`python -m draftsmith.train.pipeline ...` (the same job as `draftsmith pipeline`)."""
import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # torch is not loaded yet; see train.cli

from draftsmith.train.pipeline.run import main  # noqa: E402

main()
