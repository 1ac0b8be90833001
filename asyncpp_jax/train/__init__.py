"""Train state, runners' train steps, the trainer loop, checkpoints and metrics."""
