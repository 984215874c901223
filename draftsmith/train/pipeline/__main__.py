"""`python -m draftsmith.train.pipeline ...` (the same job as `draftsmith pipeline`)."""
from draftsmith.train.pipeline.run import main

main()
