"""`python -m draftsmith.train.distill.dataset ...` (the same job as `draftsmith generate`)."""
from draftsmith.train.distill.dataset.job import main

main()
