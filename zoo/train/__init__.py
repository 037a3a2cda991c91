"""Training with optax: losses, a jitted step, checkpoints, export back to a checkpoint directory.

    zoo.train.loss        causal-LM and MTP losses by the model's own forward (sums and means)
    zoo.train.select      which parameters train: globs over parameter paths ("mtp.*")
    zoo.train.step        Trainer: one optax update per batch, micro-batch accumulation, on a mesh
    zoo.train.checkpoint  Orbax save / restore of a TrainState (params, optimizer state, step)
    zoo.train.export      trained weights -> an HF-layout ``model.safetensors`` that ``zoo.load`` reads
    zoo.train.fit_mtp     fit an MTP head to a model as loaded (self-distillation); save it as an MTP overlay
    zoo.train.corpus      a synthetic chat corpus: dialogues rendered to (ids, loss_mask)
    zoo.train.templates   the chat formats the corpus renders with
"""
