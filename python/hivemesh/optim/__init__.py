"""Collaborative training: hivemind's ``hivemind.optim`` over hivemesh."""
