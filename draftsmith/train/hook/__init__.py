"""The retrain-on-target-update hook: `decision` (pure rules), `collaborators` (eval, generate, distill
behind protocols), `state` (one invocation's options and record), `assess` and `act` (its steps),
`jobs` (the real generate/distill calls), `cli` (``draftsmith hook target-updated ...``)."""
