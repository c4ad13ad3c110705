"""Evaluation of a run's model: held-out metrics (`metrics`), their DP release (`dp`), and
generations from public prompts (`generate`)."""
