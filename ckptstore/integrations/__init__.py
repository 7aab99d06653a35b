"""ckptstore inside the training frameworks: DeepSpeed's own save and load calls through a store."""
