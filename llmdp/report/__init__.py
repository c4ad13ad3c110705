"""What a run states: the privacy report (`build`: from the run directory and its ledger;
`render`: Markdown), ε spent over the ledger (`spent`), what may be published
(`publish`, `allowlist`) and the model card (`card`)."""
