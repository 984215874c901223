"""`draftsmith plan`: predicted speed-ups and memory per draft kind from a target config and the
hardware, before anything is trained (estimate), with the block draft's and quantized drafts' terms
(block, quant). Measured figures come from serve_eval.eval; this room only predicts."""
