"""Producing train batches: replay buffer, group filters, task allocation, batch result.

The pieces compose into one produce call like this (the producer loop owns the
timing, the engine calls and any concurrency)::

    acct = Accounting()
    buffer = ReplayBuffer(BufferConfig.from_recipe(recipe, order="fifo"), accounting=acct)
    for task, n in allocate(oversample(groups_per_step, 0.25), task_weights).items():
        ...  # take n prompts of `task` from the dataset, acct.add(their rollout ids),
        ...  # generate (plus buffer.take_expired() / take_aborted() to redo), then
        fate = buffer.put(group, train_step)  # for each generated group
    served = buffer.take(oversample(groups_per_step, 0.25), train_step)
    filled = fill_batch(served, groups_per_step, "zero_variance")
    buffer.put_back(filled.leftover)
    acct.move_groups(filled.filtered, Fate.FILTERED)
    acct.move_groups(filled.batch, Fate.TRAINED)
    controller.fit(filled.batch)
"""
