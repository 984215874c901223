"""The draft registry: `records` (what a manifest holds), `store` (the locked manifests on disk),
`cli` (``draftsmith drafts ...``)."""
