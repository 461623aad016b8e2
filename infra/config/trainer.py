"""The [trainer] section: what the trainer learns, how it batches and steps, and where checkpoints go."""

from __future__ import annotations

from dataclasses import dataclass

from agentstream.infra.config.checks import Checks


@dataclass(frozen=True)
class TrainerConfig:
    """What the trainer learns (model, LoRA, device), how it batches and steps, and where checkpoints go.

    ``model`` is a model spec (``tiny``, ``smollm2`` or a HF folder); ``model_name`` is the trained
    model's name, i.e. the transitions topic key and the checkpoint key (default: the loaded
    model's name, which is also the dev server's default served name). ``temperature`` must be
    the sampling temperature the behaviour logprobs were computed at. Batches close at
    ``batch_tokens`` padded tokens, ``batch_transitions`` transitions or once the oldest has waited
    ``batch_wait_s`` seconds since it was published (a backlog read after a restart has waited
    already; demonstrations and the supervised objective's samples, never stale, once the newest has), whichever
    comes first (0 disables a limit); with ``batch_counts_skipped`` the transitions skipped
    for zero advantage count toward ``batch_transitions`` (a step per amount of experience, not per
    amount of signal). A step's samples are cut into ``accumulation_steps`` equal micro-batches
    whose gradients add up; with ``micro_batch_tokens`` > 0 each is cut further so that it holds at
    most that many padded tokens (samples × the longest of them; a longer sample goes alone), which
    bounds the activations a step keeps however long its trajectories are (0: no such cut).
    ``checkpoint_dir`` is a folder, a ``file://`` URI or ``s3://bucket/prefix`` (see ``[checkpoints]``;
    default: ``checkpoints`` under the stack home). The optimizer state (AdamW's moments: twice
    the weights, 1 GB for SmolLM2, 2 s to write on a CPU) goes with every ``optimizer_state_every``-th
    checkpoint (0: none); a trainer resumed from a checkpoint without it starts the moments afresh
    and says so. ``threads`` is torch's CPU thread count (0: torch's
    default); ``importance_cap`` is the truncation c of the importance ratio (see ``trainer/loss.py``).
    ``dtype`` is the compute dtype (``auto``: bfloat16 autocast on CUDA, float32 elsewhere);
    weights and optimizer state stay ``weights_dtype``, float32 unless pure bfloat16 is asked for
    (which loses updates below bfloat16's resolution, and warns). See ``models/precision.py``.
    ``checkpoint_dtype`` is the dtype of full weights in checkpoints (``auto``: ``weights_dtype``).
    ``bfloat16`` over float32 weights halves what the trainer writes and hashes and what hot swap
    hashes and the server loads per version, and a server computing in bfloat16 serves the same
    Linear weights either way; a trainer resumed from such a checkpoint starts from weights rounded
    to bfloat16 (it says so). LoRA adapters are written as trained. ``attention`` is the trained
    model's attention kernel: ``auto`` is ``eager`` on the CPU, where torch's fused attention
    spent 0.9 s of a 5.3 s SmolLM2 step in its backward on RL-length sequences (a 37-token
    prompt, 24-token answers), and ``sdpa`` elsewhere; eager keeps every attention matrix for the
    backward, so set ``sdpa`` to train long sequences on a CPU. The model server keeps ``sdpa``,
    which generated a wave faster there (3.7 s against 4.7 s).
    With ``rebase_after_rejections`` N > 0, after the promotion gate refused N of this model's
    candidates in a row (rejected or rolled back), the trainer goes back to the version serving
    users and trains on from it (``deploy/rebase.py``); 0 never does.
    ``loss_normalization`` is how a step's token losses are averaged: ``token`` (every trained token
    of the step weighs the same, so long samples weigh more), ``transition`` (each sample's mean,
    then the mean over samples) or ``rollout`` (each rollout's token mean, then the mean over
    rollouts: a rollout of many calls or long tool loops counts as much as a short one).
    Under ``torchrun`` (``WORLD_SIZE`` set) the trainer runs as data-parallel ranks
    (``trainer/distributed.py``): ``distributed_backend`` is ``gloo``, ``nccl`` or ``auto`` (NCCL
    where the trainer's device is CUDA, gloo elsewhere); a collective that waits longer than
    ``distributed_timeout_s`` fails and the rank exits (rank 0 keeps idle ranks waiting well
    within it).
    ``objective`` is what a step optimises: ``policy_gradient`` (the loss in ``trainer/loss.py``,
    from advantages) or ``supervised`` (rejection-sampling fine-tuning: only samples whose rollout
    reward is at least ``supervised_min_reward`` are trained, by the negative log-likelihood of
    their trained tokens, advantages ignored; the others are counted, see ``trainer/batching.py``).
    """

    model: str = "smollm2"
    model_name: str | None = None
    device: str = "auto"
    dtype: str = "auto"
    weights_dtype: str = "float32"
    checkpoint_dtype: str = "auto"
    attention: str = "auto"
    threads: int = 2
    seed: int = 0
    lr: float = 1e-5
    beta1: float = 0.9
    beta2: float = 0.99
    weight_decay: float = 0.0
    clip_eps: float = 0.2
    importance_cap: float = 2.0
    grad_clip: float = 1.0
    accumulation_steps: int = 1
    temperature: float = 1.0
    kl_coef: float = 0.0
    entropy_coef: float = 0.0
    reference_model: str | None = None
    lora: bool = False
    lora_r: int = 16
    lora_alpha: int = 32
    lora_target_modules: str = "q_proj,k_proj,v_proj,o_proj"
    batch_tokens: int = 16384
    micro_batch_tokens: int = 0
    batch_transitions: int = 64
    batch_wait_s: float = 5.0
    max_policy_lag: int = 4
    skip_zero_advantage: bool = True
    batch_counts_skipped: bool = False
    dedupe_window: int = 100_000
    checkpoint_dir: str = ""
    checkpoint_every_steps: int = 1
    optimizer_state_every: int = 1
    keep_checkpoints: int = 0
    rebase_after_rejections: int = 0
    loss_normalization: str = "token"
    session_timeout_s: float = 4.0  # tansu holds a join about half of it (see infra/members.py)
    shutdown_grace_s: float = 30.0  # time to write a last checkpoint after SIGTERM; then it exits regardless
    distributed_backend: str = "auto"
    distributed_timeout_s: float = 600.0
    objective: str = "policy_gradient"
    supervised_min_reward: float = 1.0

    def __post_init__(self) -> None:
        check = Checks("trainer", self)
        check.device("device")
        check.one_of("dtype", ("auto", "float32", "bfloat16"))
        check.one_of("weights_dtype", ("float32", "bfloat16"))
        check.one_of("checkpoint_dtype", ("auto", "float32", "bfloat16"))
        check.one_of("attention", ("auto", "eager", "sdpa"))
        check.above("lr", 0)
        check.within("clip_eps", "(0, 1)")
        check.above("importance_cap", 1)
        check.above("temperature", 0)
        check.at_least("accumulation_steps", 1)
        check.at_least("batch_transitions", 0)
        check.at_least("batch_tokens", 0)
        check.that(max(self.batch_transitions, self.batch_tokens) > 0,
                   "batch_transitions and batch_tokens are both 0: one of them must be > 0")
        check.at_least("micro_batch_tokens", 0)
        check.at_least("max_policy_lag", 0)
        check.at_least("checkpoint_every_steps", 1)
        check.at_least("optimizer_state_every", 0)
        check.at_least("lora_r", 1)
        check.at_least("rebase_after_rejections", 0)
        check.one_of("loss_normalization", ("token", "transition", "rollout"))
        check.one_of("distributed_backend", ("auto", "gloo", "nccl"))
        check.above("distributed_timeout_s", 0)
        check.one_of("objective", ("policy_gradient", "supervised"))
        check.finite("supervised_min_reward")
