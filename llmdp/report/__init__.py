"""What a run states: the privacy report (`build`: from the run directory and its ledger;
`render`: Markdown), ε spent over the ledger (`spent`), the model card (`card`), and runs side
by side (`compare`, ``llmdp compare``). What of a run may be published is
`llmdp.record.publish` (its allow-lists: `llmdp.privacy.allowlist`)."""
