"""Examples built on april-server and its client: `train_demo` is `make train-demo` (TRL's
GRPOTrainer sync vs APRIL vs APRIL + background), with its task (`train_task`) and report."""
