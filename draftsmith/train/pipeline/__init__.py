"""The main job, ``draftsmith pipeline``: cached stages run in order (run), over one context (context):
build (corpus, tokenizer, target), distill (generate, distill_<kind>), cost, evaluate (eval, report,
register)."""
