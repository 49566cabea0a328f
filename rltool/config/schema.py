"""Typed recipe configuration: one dataclass per recipe section.

A recipe YAML is merged onto ``RecipeConfig`` by ``rltool.config.loader``;
nothing after loading sees a raw DictConfig. Defaults here are the values a
recipe gets when it says nothing. The ``algorithm`` section and its sub-sections live in
``rltool.config.algorithm`` (``AlgorithmConfig`` is importable from here too).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from rltool.config.algorithm import AlgorithmConfig


@dataclass
class LoraConfig:
    """``model.lora``: train low-rank adapters (peft) instead of the whole policy."""

    enabled: bool = False
    rank: int = 16  # r
    alpha: float = 32.0  # the update is scaled by alpha / rank
    dropout: float = 0.0
    # module names to adapt (peft's target_modules); the default is every linear layer
    # of a Llama/Qwen decoder (not the LM head)
    target_modules: list[str] = field(
        default_factory=lambda: [
            "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
        ]
    )  # fmt: skip
    # what a weight sync sends to an engine that loads adapters (vLLM, in process or
    # served): adapters (megabytes; vLLM's LoRA kernels) | merged (full weights, base kernels)
    sync: str = "adapters"


@dataclass
class ModelConfig:
    path: str = "builtin:tiny-gsm8k"  # a local HF checkpoint dir, or builtin:<name>
    dtype: str = "float32"  # float32 | bfloat16 | float16
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    attn_implementation: str = "sdpa"
    lora: LoraConfig = field(default_factory=LoraConfig)


@dataclass
class SamplingConfig:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    max_new_tokens: int = 64
    stop: list[str] = field(default_factory=list)


@dataclass
class ServerOptions:
    """``rollout.engine: openai_server``: how rltool talks to the servers (docs/engines.md)."""

    model: str = ""  # the model name the servers serve ("" = model.path)
    api_key_env: str = ""  # environment variable holding the API key ("" = none)
    timeout_s: float = 600.0  # one completions request, connect to last byte
    retries: int = 2  # other servers tried after a request fails on one
    concurrency: int = 8  # requests in flight per server
    # the most seconds one round of requests (a generate; each chunk with chunk_tokens)
    # waits, queueing and retries included; null = each request timeout_s per attempt
    deadline_s: float | None = None
    # weight updates: a directory every server can read, and the collective_rpc method of
    # the server's worker extension that loads a safetensors file from it
    weights_dir: str = ""  # "" = weights cannot be updated (the run fails at the first sync)
    update_method: str = "rltool_load_weights"
    # collective_rpc method called on every server at start so that its logprobs are the
    # trainer's (vllm serve --logprobs-mode processed_logprobs); "" = the server's as they are
    logprobs_method: str = "rltool_tempered_logprobs"


@dataclass
class VLLMConfig:
    """``rollout.engine: vllm`` (vLLM in this process; docs/engines.md#the-vllm-engine)."""

    # share of GPU memory vLLM may take (weights + KV cache); on the CPU backend the share
    # of host memory it reserves, where vLLM's own default (0.92) refuses to start
    gpu_memory_utilization: float = 0.1
    enforce_eager: bool = True  # False: CUDA graphs on a GPU (compile time at start)
    dtype: str = ""  # "" = model.dtype | float32 | bfloat16 | float16
    # colocated on one GPU: vLLM sleeps (frees its KV cache, offloads weights) while the
    # trainer trains and wakes for the next generate; GPU only
    enable_sleep_mode: bool = False
    tensor_parallel_size: int = 1
    max_model_len: int | None = None  # None = the checkpoint's context length
    seed: int = 0  # vLLM's sampling seed


@dataclass
class RolloutConfig:
    engine: str = "hf"  # hf (in-process generate) | vllm | openai_server
    servers: list[str] = field(default_factory=list)  # openai_server: base URLs (…/v1)
    server: ServerOptions = field(default_factory=ServerOptions)
    batch_size: int = 64  # sequences per generate call
    backend: str = "inprocess"  # inprocess (one machine, default) | ray (workers as Ray actors)
    num_workers: int = 1  # Ray rollout actors (backend: ray)
    ray_address: str | None = None  # None = start a local Ray; else a cluster address
    worker_threads: int = 1  # torch threads per rollout worker
    # partial rollouts: every this many new tokens is a pause point where a generation
    # in flight takes weights synced meanwhile and continues with them (it stops only
    # when new weights wait)
    chunk_tokens: int | None = None  # None = no pause points: new weights wait for the next call
    vllm: VLLMConfig = field(default_factory=VLLMConfig)  # rollout.engine: vllm
    # rollout.engine: hf: lean (own decode loop on a static KV cache) | reference (generate)
    hf_decode: str = "lean"
    # hf_decode: lean: rows its refill loop decodes at once (a finished row's slot takes the
    # next prompt), fewer where their KV cache would take more than hf_cache_memory of the
    # device's free memory, but never fewer than batch_size (the per-batch paths' rows)
    hf_slots: int = 256
    hf_cache_memory: float = 0.25
    # record each position's MoE experts (routed_experts); None = when the model has routers
    record_routing: bool | None = None
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    eval_sampling: SamplingConfig = field(
        default_factory=lambda: SamplingConfig(temperature=0.0)
    )  # temperature 0 = greedy


@dataclass
class AgentLoopConfig:
    name: str = "gsm8k"
    # loop-specific options (data files, agent import paths, ...), checked by the loop
    options: dict[str, Any] = field(default_factory=dict)


@dataclass
class ReasoningGymConfig:
    """``data.reasoning_gym`` (or ``tasks[i].reasoning_gym``): the rows of a reasoning-gym
    generator, read when the preset is ``reasoning_gym`` (docs/environments.md)."""

    dataset: str = ""  # the generator's name (reasoning_gym.create_dataset), e.g. chain_sum
    size: int = 1000  # training rows: row i is drawn with seed + i
    seed: int = 0
    eval_size: int = 200  # held-out rows, drawn with eval_seed + i
    eval_seed: int | None = None  # None = seed + size; the two seed ranges must not overlap
    # where the answer is in a response: answer_tag (<answer>...</answer>, reasoning-gym's
    # prompts) | gsm8k (after the last ####, the demo model's format)
    answer_format: str = "answer_tag"
    config: dict[str, Any] = field(default_factory=dict)  # the generator's own config


@dataclass
class DataConfig:
    train_files: list[str] = field(default_factory=lambda: ["builtin:gsm8k_tiny/train.jsonl"])
    eval_files: list[str] = field(default_factory=lambda: ["builtin:gsm8k_tiny/test.jsonl"])
    prompts_per_step: int = 32
    group_size: int = 8
    eval_limit: int = 200  # held-out problems per evaluation (0 = all)
    shuffle: bool = True
    # where a record's fields come from: a preset (gsm8k | verl) and dotted paths that
    # override it; docs/foundations.md#task-records. reasoning_gym: the rows come from the
    # generator of data.reasoning_gym, not from train_files/eval_files
    preset: str = ""  # "" = gsm8k: question, answer
    prompt_key: str = ""  # a string, or chat messages (verl: prompt)
    answer_key: str = ""  # the ground truth (verl: reward_model.ground_truth)
    task_key: str = ""  # kept on the row as "task" (verl: data_source)
    # a prompt too long for the model's context with max_new_tokens after it: skip
    # (dropped, counted per file) | error (refused before the model loads)
    too_long: str = "skip"
    reasoning_gym: ReasoningGymConfig = field(default_factory=ReasoningGymConfig)


@dataclass
class TaskConfig:
    """One task of a multi-task recipe: its own loop, data, share of the batch."""

    name: str = ""
    weight: float = 1.0  # share of each step's groups (floor, then largest remainder)
    agent_loop: AgentLoopConfig = field(default_factory=AgentLoopConfig)
    train_files: list[str] = field(default_factory=list)
    eval_files: list[str] = field(default_factory=list)
    # the record mapping of this task's files; all four empty = data.*'s
    preset: str = ""
    prompt_key: str = ""
    answer_key: str = ""
    task_key: str = ""
    reasoning_gym: ReasoningGymConfig = field(default_factory=ReasoningGymConfig)  # preset


@dataclass
class ProduceConfig:
    """How batches are produced (issue: asynchronous production)."""

    mode: str = "sync"  # sync: generate, train, repeat | async: generation overlaps training
    oversample: float = 0.0  # extra groups generated per step, as a fraction of the batch
    group_filter: str = "none"  # none | zero_variance (registered group filters)
    buffer_order: str = "fifo"  # fifo | stalest
    expired: str = "retry"  # retry (reset to the prompt) | drop
    max_inflight_steps: int = 1  # async: how many steps of groups may be generated ahead


@dataclass
class DistillConfig:
    """On-policy distillation: a teacher scores the student's sampled tokens."""

    teacher_path: str | None = None  # None = off; a local HF checkpoint or builtin:<name>
    mode: str = "topk"  # topk: forward KL on the teacher's top-k | sampled: reverse KL
    top_k: int = 8
    coef: float = 1.0  # weight of the distillation loss beside the policy loss


@dataclass
class OptimizerConfig:
    lr: float = 1e-6
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    warmup_steps: int = 0
    schedule: str = "constant"  # constant | cosine | linear
    min_lr_ratio: float = 0.0
    grad_clip: float = 1.0
    # start from AdamW moments saved beside the weights (optimizer.pt), e.g. the
    # demo model's warm start; a fresh optimizer at full lr first undoes much of it
    init_from_checkpoint: bool = False


# trainer.alarms: the health alarms app/alarms.py computes each step
# (docs/metrics.md#health-alarms); a test keeps the two equal
ALARM_NAMES = (
    "length", "truncation", "entropy", "reward_hacking", "reward_component", "mismatch",
    "grad_norm",
)  # fmt: skip


@dataclass
class AlarmsConfig:
    """``trainer.alarms``: signals that a run is going wrong, from the figures each step
    logs; null turns an alarm off. ``baseline`` is the mean of a figure over the run's
    first ``baseline_steps`` steps (the steps so far while there are fewer)."""

    baseline_steps: int = 10
    length_ratio: float | None = 2.0  # rollout/response_len/mean > ratio x its baseline
    truncated_frac: float | None = 0.3  # rollout/truncated_frac above this
    entropy_ratio: float | None = 0.2  # actor/entropy < ratio x its baseline
    # reward hacking: between the last two evaluations, eval/accuracy fell by more than
    # accuracy_drop while the sampled reward rose by more than reward_rise
    accuracy_drop: float | None = 0.05
    reward_rise: float | None = 0.05
    component_share: float | None = 0.9  # one reward component's share of |components| above
    mismatch_kl: float | None = 0.01  # mismatch/kl_k3 (engine vs trainer) above this
    grad_norm_ratio: float | None = 5.0  # actor/grad_norm > ratio x median of the last steps
    stop_on: list[str] = field(default_factory=list)  # alarms that stop the run (exit 3)


@dataclass
class TrainerConfig:
    steps: int = 100
    seed: int = 0
    pack_max_length: int = 2048  # tokens per packed row, also the micro-batch token budget
    # lay each prompt out once per row, its samples as branches (same losses, fewer tokens);
    # plain rows where the attention has no kernel for them (flash attention on the CPU)
    prefix_sharing: bool = True
    eval_every: int = 10  # 0 = only at start and end
    save_every: int = 0  # 0 = only at the end
    time_budget_s: float | None = None  # stop early after this many seconds of training
    # stop (exit 3) after this many consecutive steps in which every sample failed
    max_failed_steps: int = 3
    # the same recipe and seed give the same metrics and weights (deterministic kernels;
    # not with async production, Ray workers or vLLM): docs/replay.md#deterministic-mode
    deterministic: bool = False
    # torch's intra-op threads for this run (float sums depend on the count); null = the
    # machine's default, which trainer.deterministic warns about
    threads: int | None = None
    # off | layers: the train step's forwards run torch.compile'd decoder layers (attention
    # eager); eager is the reference; the first step pays the compile: docs/foundations.md
    compile: str = "off"
    alarms: AlarmsConfig = field(default_factory=AlarmsConfig)


@dataclass
class LoggingConfig:
    run_dir: str = "runs"
    name: str = "run"
    # experiment trackers each metrics line also goes to: tensorboard, wandb (optional extras)
    trackers: list[str] = field(default_factory=list)
    tensorboard: bool = False  # alias of listing tensorboard in trackers
    project: str = "rltool"  # the tracker's project (W&B), runs named by ``name``
    dump_rollouts: bool = False


@dataclass
class DistributedConfig:
    """Data parallelism with FSDP2: docs/distributed.md."""

    nproc_per_node: int = 1  # > 1: `rltool train` relaunches itself through torch.distributed.run
    nnodes: int = 1  # > 1: start `torchrun --nnodes N ...` on every node yourself
    strategy: str = "full_shard"  # full_shard (ZeRO-3) | shard_grad_op (ZeRO-2: no re-shard)
    mixed_precision: str = "none"  # none | bf16 (CUDA only: bf16 compute, fp32 reduction)
    activation_checkpointing: bool = False  # recompute each decoder layer in backward
    cpu_offload: bool = False  # parameters, gradients and optimizer state on the CPU


@dataclass
class RecipeConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    agent_loop: AgentLoopConfig = field(default_factory=AgentLoopConfig)
    data: DataConfig = field(default_factory=DataConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    produce: ProduceConfig = field(default_factory=ProduceConfig)
    # multi-task: when non-empty, replaces agent_loop + data.train_files/eval_files
    tasks: list[TaskConfig] = field(default_factory=list)
    distill: DistillConfig = field(default_factory=DistillConfig)
    distributed: DistributedConfig = field(default_factory=DistributedConfig)
