"""Training: the optimizer and its schedules (`optim.py`), the loss and the jit-compiled train
step (`step.py`), task heads' losses and batch shapes (`tasks.py`), fine-tuning runs and the one
`load_run_config` (`finetune.py`), metrics logs (`metrics.py`) and the training loop behind
train.py (`trainer.py`)."""
