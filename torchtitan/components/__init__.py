"""Training components: optimizer, lr schedule, loss, metrics, checkpointing (see docs/design.md)."""
