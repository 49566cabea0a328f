"""Running agent loops written for verl's agent-loop interface inside rltool.

verl (0.9) defines an agent loop as a class built with ``(trainer_config,
server_manager, tokenizer, processor, dataset_cls, data_config, ...)`` whose
``async run(sampling_params, **task_fields)`` returns an ``AgentLoopOutput``
(prompt_ids, response_ids, response_mask, response_logprobs, reward_score,
num_turns, extra_fields). This package supplies what such a loop talks to, all
duck-typed so that verl is not a dependency of rltool:

- ``config``: the verl-shaped configuration a loop reads, and tool loading;
- ``server``: the server manager whose ``generate`` runs on rltool's engine,
  its concurrent calls gathered into one engine call (``rltool.engines.batcher``);
- ``convert``: an ``AgentLoopOutput`` to canonical train fields.

The agent loop that uses them is ``rltool.agent_loops.verl``.
"""
