"""Tiny, deterministic, real DeepSpeed engines for tests, demos and benchmarks.

Shared by ``tests/`` (``from tools.engines import ...``; tests/conftest.py puts the repo root on
sys.path) and by ``tools/demo.py`` / ``tools/bench.py``.

    setup_single_process_env()                  # before the first build_engine (idempotent)
    eng = build_engine("llama", zero_stage=2, dtype="bf16", seed=0)
    losses = train(eng, batches(3))
    eng.save_checkpoint(path)
    destroy_engine(eng)                         # optional, frees memory between engines

Notes for building many engines in ONE process (what pytest does), checked with deepspeed 0.19.8,
torch 2.13 CPU:

* ``deepspeed`` must be imported only after ``DS_ACCELERATOR=cpu`` is set (the accelerator is picked
  once, at first use); ``setup_single_process_env`` does that and this module imports deepspeed lazily.
* The process group is created once, by the first ``deepspeed.initialize`` (via
  ``deepspeed.init_distributed``, gloo backend on CPU), and reused by every later engine. Never
  destroy it between engines; ``build_engine`` calls ``init_distributed`` itself, which is a no-op
  once initialized. The first build also JIT-compiles DeepSpeed's shm comm op (gcc, a few seconds,
  cached afterwards in this checkout's own TORCH_EXTENSIONS_DIR, see ``own_torch_extensions_dir``).
* The first engine in a process takes ~5 s (transformers' and DeepSpeed's lazy imports, loading the
  JIT-built ops; py-cpuinfo's 2.2 s is answered from a file, see ``remember_cpu_info``); later
  ones ~0.03 s (ZeRO 3: ~0.3 s). On a checkout with an empty TORCH_EXTENSIONS_DIR
  the first build JIT-compiles deepspeed_shm_comm (~45 s) and fused_adam (~85 s), and the first
  ZeRO-Offload engine (DeepSpeedCPUAdam) cpu_adam (~90 s): a fresh clone's CI pays each once.
  ``optimizer={"params": {"torch_adam": True}}`` skips the fused_adam build.
* Old engines need not be destroyed for correctness: engines built one after another are fully
  independent (same seed -> bit-identical losses, whatever was built before). But ``del engine``
  frees NOTHING (reference cycles plus two DeepSpeed globals, see ``destroy_engine``): memory grows
  by the whole engine each time. Call ``destroy_engine`` when done with an engine (checkpoint files
  already written stay valid; the engine is unusable afterwards).
* Exit: no abort at interpreter exit was reproduced (rc 0 / the right status) with live ZeRO 0-3
  engines, with or without destroying the process group, after save_checkpoint, after exceptions,
  under pytest, torch.distributed.run (1 and 2 ranks), mp.spawn, fork/spawn pools.
  ``finalize_distributed`` (called by tests/conftest.py at session end) is insurance only.
* fp16: DeepSpeed's CPU accelerator allows fp16 iff ``torch.ops.mkldnn._is_mkldnn_fp16_supported()``
  (AVX512-FP16 CPUs, as on the dev box): there it trains and resumes bit-exactly too; elsewhere
  deepspeed.initialize raises ``ValueError: Type fp16 is not supported on your device.``
* Determinism: dropout is disabled in both models (RNG state is not part of a DeepSpeed checkpoint,
  so dropout would break bit-exact resume comparisons), attention is "eager", and the model is built
  under ``torch.manual_seed(seed)`` with the global RNG state restored afterwards.
"""

from __future__ import annotations

import copy
import gc
import os
import socket
import sys
from typing import Any

import torch

__all__ = [
    "setup_single_process_env",
    "build_model",
    "build_engine",
    "ds_config",
    "batches",
    "train",
    "destroy_engine",
    "finalize_distributed",
    "param_count",
    "free_port",
    "add_bench_model_options",
    "build_bench_engine",
]


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def two_node_agents(
    script: list[str], env: dict | None = None, timeout: float | None = None
) -> list[tuple[int, str]]:
    """Run ``script`` (a script's path and its arguments) under two torchrun agents of one rank
    each on this machine, standing for two nodes (``--nnodes 2``, node ranks 0 and 1); each
    agent's exit code and output, once both ended (subprocess.TimeoutExpired past ``timeout``
    seconds, both killed)."""
    import subprocess
    import sys

    port = free_port()
    agents = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--nnodes",
                "2",
                "--node_rank",
                str(node),
                "--nproc_per_node",
                "1",
                "--master_addr",
                "127.0.0.1",
                "--master_port",
                str(port),
                *script,
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
        )  # fmt: skip
        for node in (0, 1)
    ]
    try:
        outputs = [agent.communicate(timeout=timeout)[0] for agent in agents]
    finally:
        for agent in agents:
            agent.kill()  # a hung job: none outlives the caller
    return [(agent.returncode, output) for agent, output in zip(agents, outputs, strict=True)]


def own_torch_extensions_dir() -> str:
    """This checkout's own folder for DeepSpeed's JIT-built ops: the running virtual environment's
    ``torch_extensions`` (``.venv/torch_extensions`` under the README's set-up), else
    ``.torch_extensions`` at the repository root.

    Why not ~/.cache/torch_extensions: a job killed while building an op leaves a ``lock`` file there
    that makes every later build in that cache wait forever, and a venv at another path makes
    DeepSpeed rebuild every op in it; a checkout's own folder is stalled by nothing outside it."""
    if sys.prefix != sys.base_prefix:
        return os.path.join(sys.prefix, "torch_extensions")
    return os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), ".torch_extensions")


def remember_cpu_info() -> None:
    """Make py-cpuinfo's ``get_cpu_info`` answer from a file kept beside this checkout's JIT-built
    ops, once it has asked the CPU a first time on this host.

    Why: DeepSpeed's CPU op builders ask py-cpuinfo for the architecture and SIMD width (twice)
    each time an op loads, that is in every process's first engine and in every engine with
    DeepSpeedCPUAdam, and py-cpuinfo answers each call from a fresh Python process of its own:
    2.2 s of a process's 7 s first engine on the 2-core box. The answer is the same real one
    (the JSON py-cpuinfo's own process prints, read back); the ops it sets the flags of are built
    for this very CPU (-march=native) in the same folder. Idempotent."""
    import functools
    import json
    import platform

    try:
        import cpuinfo
    except ImportError:  # DeepSpeed is not installed (it brings py-cpuinfo): nothing asks it
        return
    if getattr(cpuinfo.get_cpu_info, "remembered", False):
        return
    asked = cpuinfo.get_cpu_info
    path = os.path.join(own_torch_extensions_dir(), f"cpu_info-{platform.node()}.json")

    @functools.cache
    def get_cpu_info() -> dict:
        try:
            with open(path) as kept:
                return json.load(kept)
        except (OSError, ValueError):
            info = asked()
        try:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            partial = f"{path}.{os.getpid()}.tmp"
            with open(partial, "w") as out:
                json.dump(info, out)
            os.replace(partial, path)  # whole or absent, whichever process writes it
        except OSError:
            pass  # a read-only checkout asks again next time
        return info

    get_cpu_info.remembered = True
    get_cpu_info.asked = asked  # py-cpuinfo's own, for a check that the answers agree
    cpuinfo.get_cpu_info = get_cpu_info


def setup_single_process_env() -> None:
    """Environment for a 1-rank CPU DeepSpeed job. Never overrides values already set (e.g. by
    torch.distributed.run / the deepspeed launcher); JIT-built ops go to this checkout's own folder
    (``own_torch_extensions_dir``) unless TORCH_EXTENSIONS_DIR is set."""
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", own_torch_extensions_dir())
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    if "MASTER_PORT" not in os.environ:
        os.environ["MASTER_PORT"] = str(free_port())
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    os.environ.setdefault("LOCAL_RANK", "0")
    os.environ.setdefault("LOCAL_WORLD_SIZE", os.environ["WORLD_SIZE"])


def _deep_update(base: dict, over: dict) -> dict:
    for k, v in over.items():
        if isinstance(v, dict) and isinstance(base.get(k), dict):
            _deep_update(base[k], v)
        else:
            base[k] = v
    return base


def build_model(
    model: str = "llama",
    seed: int = 0,
    num_layers: int = 4,
    hidden: int = 32,
    vocab: int = 128,
    max_positions: int = 256,
) -> torch.nn.Module:
    """A tiny randomly initialised HF causal LM, in fp32.

    llama: ``LlamaForCausalLM`` with untied embeddings; gpt2: ``GPT2LMHeadModel`` (tied wte/lm_head).
    Sizes scale with ``hidden``: heads = max(1, hidden // 64) (min 4 heads when hidden >= 32 and
    divisible), intermediate = ~8/3 * hidden (llama, rounded to a multiple of 8) / 4 * hidden (gpt2).
    """
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    if hidden >= 256:
        heads = max(1, hidden // 64)
    else:
        heads = 4 if hidden % 4 == 0 and hidden >= 16 else 1
    assert hidden % heads == 0, (hidden, heads)

    rng_state = torch.get_rng_state()
    torch.manual_seed(seed)
    try:
        if model == "llama":
            inter = max(8, (8 * hidden // 3 + 7) // 8 * 8)
            cfg = LlamaConfig(
                vocab_size=vocab,
                hidden_size=hidden,
                intermediate_size=inter,
                num_hidden_layers=num_layers,
                num_attention_heads=heads,
                num_key_value_heads=heads,
                max_position_embeddings=max_positions,
                tie_word_embeddings=False,
                attention_dropout=0.0,
                rms_norm_eps=1e-5,
            )
            cfg._attn_implementation = "eager"
            m = LlamaForCausalLM(cfg)
        elif model == "gpt2":
            cfg = GPT2Config(
                vocab_size=vocab,
                n_embd=hidden,
                n_layer=num_layers,
                n_head=heads,
                n_positions=max_positions,
                n_inner=4 * hidden,
                tie_word_embeddings=True,
                resid_pdrop=0.0,
                embd_pdrop=0.0,
                attn_pdrop=0.0,
                summary_first_dropout=0.0,
                bos_token_id=0,
                eos_token_id=0,
            )
            cfg._attn_implementation = "eager"
            m = GPT2LMHeadModel(cfg)
        else:
            raise ValueError(f"unknown model {model!r} (llama | gpt2)")
    finally:
        torch.set_rng_state(rng_state)
    m.train()
    return m


def param_count(module: torch.nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def _param_groups(module: torch.nn.Module, weight_decay: float) -> list[dict]:
    """The common HF split: no weight decay for biases and norm weights -> 2 param groups."""
    decay, no_decay = [], []
    for name, p in module.named_parameters():  # tied params are yielded once
        if not p.requires_grad:
            continue
        lname = name.lower()
        if name.endswith("bias") or "norm" in lname or ".ln_" in lname:
            no_decay.append(p)
        else:
            decay.append(p)
    return [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]


def ds_config(
    zero_stage: int = 0,
    dtype: str = "fp32",
    scheduler: bool = True,
    lr: float = 1e-2,
    weight_decay: float = 0.01,
    **config_overrides: Any,
) -> dict:
    """The DeepSpeed config dict used by build_engine (config_overrides are deep-merged)."""
    if dtype not in ("fp32", "bf16", "fp16"):
        raise ValueError(f"dtype must be fp32|bf16|fp16, not {dtype!r}")
    cfg: dict = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 1.0,
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
        "optimizer": {
            "type": "AdamW",
            "params": {"lr": lr, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": weight_decay},
        },
        "zero_optimization": {"stage": zero_stage},
    }
    if scheduler:
        cfg["scheduler"] = {
            "type": "WarmupLR",
            "params": {
                "warmup_min_lr": 0.0,
                "warmup_max_lr": lr,
                "warmup_num_steps": 10,
                "warmup_type": "linear",
            },
        }
    if dtype == "bf16":
        cfg["bf16"] = {"enabled": True}
    elif dtype == "fp16":
        cfg["fp16"] = {"enabled": True, "initial_scale_power": 8}
    return _deep_update(cfg, copy.deepcopy(config_overrides))


def build_engine(
    model: str = "llama",
    zero_stage: int = 0,
    dtype: str = "fp32",
    seed: int = 0,
    num_layers: int = 4,
    hidden: int = 32,
    vocab: int = 128,
    scheduler: bool = True,
    lr: float = 1e-2,
    weight_decay: float = 0.01,
    **config_overrides: Any,
):
    """Build a real DeepSpeed engine around a tiny HF model (see build_model / ds_config).

    Optimizer: DeepSpeed's "AdamW" (FusedAdam in adam_w_mode, which works on CPU); pass
    ``optimizer={"params": {"torch_adam": True}}`` to get torch.optim.AdamW instead.
    Two param groups (decay / no decay). fp16 is passed through; the CPU accelerator refuses it.
    """
    setup_single_process_env()
    import deepspeed

    # No-op after the first call; the process group lives for the whole process.
    deepspeed.init_distributed(dist_backend=None, verbose=False)

    module = build_model(model, seed=seed, num_layers=num_layers, hidden=hidden, vocab=vocab)
    cfg = ds_config(
        zero_stage, dtype, scheduler=scheduler, lr=lr, weight_decay=weight_decay, **config_overrides
    )
    engine, _opt, _dl, _sched = deepspeed.initialize(
        model=module, model_parameters=_param_groups(module, weight_decay), config=cfg
    )
    return engine


class PipelineBlock(torch.nn.Module):
    """A residual MLP block with a LayerNorm: one pipeline layer of ``build_pipeline_engine``."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(hidden, hidden)
        self.norm = torch.nn.LayerNorm(hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(x + torch.relu(self.fc(x)))


def _tied_logits(embedding: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    # The output layer is the input embedding transposed (a TiedLayerSpec's forward_fn).
    return (x @ embedding.weight.t()).reshape(-1, embedding.weight.shape[0])


def build_pipeline_engine(
    stages: int = 2,
    zero_stage: int = 1,
    dtype: str = "fp32",
    seed: int = 0,
    num_layers: int = 4,
    hidden: int = 32,
    vocab: int = 128,
    **config_overrides: Any,
):
    """A DeepSpeed ``PipelineEngine`` over a tiny language model split into ``stages`` stages:
    a tied embedding (``TiedLayerSpec``, layer 0 and the output layer), then ``num_layers``
    ``PipelineBlock`` layers. Train it with ``train_pipeline``; every rank of the job calls this."""
    setup_single_process_env()
    import deepspeed
    from deepspeed.pipe import LayerSpec, PipelineModule, TiedLayerSpec

    deepspeed.init_distributed(dist_backend=None, verbose=False)
    torch.manual_seed(seed)
    layers = [
        TiedLayerSpec("embed", torch.nn.Embedding, vocab, hidden, tied_weight_attr="weight"),
        *[LayerSpec(PipelineBlock, hidden) for _ in range(num_layers)],
        TiedLayerSpec(
            "embed", torch.nn.Embedding, vocab, hidden, forward_fn=_tied_logits, tied_weight_attr="weight"
        ),
    ]
    module = PipelineModule(
        layers, num_stages=stages, loss_fn=torch.nn.CrossEntropyLoss(), partition_method="uniform"
    )
    cfg = ds_config(zero_stage, dtype, **config_overrides)
    cfg["gradient_accumulation_steps"] = 2  # micro-batches, so that the stages overlap
    engine, *_ = deepspeed.initialize(
        model=module, model_parameters=[p for p in module.parameters() if p.requires_grad], config=cfg
    )
    return engine


def build_autotp_engine(
    tp: int = 2,
    zero_stage: int = 1,
    dtype: str = "fp32",
    seed: int = 0,
    num_layers: int = 2,
    **overrides: Any,
):
    """A tiny Llama split over ``tp`` tensor-parallel ranks by DeepSpeed's AutoTP (the data
    parallel over the rest); every rank of a slice group must train on the same batches."""
    if tp > 1:
        overrides.setdefault("tensor_parallel", {"autotp_size": tp})
    return build_engine(
        "llama", zero_stage=zero_stage, dtype=dtype, seed=seed, num_layers=num_layers, **overrides
    )


# AutoTP's layout of Phi-3 (fused qkv_proj and gate_up_proj) with grouped-query attention, as
# a DeepSpeed config gives it. DeepSpeed 0.19 takes no other way on CPU: without a config it
# follows the model's Hugging Face tp_plan and refuses it ("HuggingFace tp_plan contains
# unsupported partition style(s): ['rowwise_split_input']"), and its "phi3" preset cuts q, k
# and v as three equal parts (shape (3, -1)), which grouped-query attention's are not.
def _fused_qkv_partition_config(heads: int, kv_heads: int, head_dim: int) -> dict:
    sizes = [heads * head_dim, kv_heads * head_dim, kv_heads * head_dim]
    return {
        "use_default_specs": False,
        "layer_specs": [
            {"patterns": [r".*\.self_attn\.o_proj\.weight$"], "partition_type": "row"},
            {"patterns": [r".*\.self_attn\.qkv_proj\.weight$"], "partition_type": "column",
             "shape": [sizes, -1], "partition_dim": 0},
            {"patterns": [r".*\.mlp\.down_proj\.weight$"], "partition_type": "row"},
            {"patterns": [r".*\.mlp\.gate_up_proj\.weight$"], "partition_type": "column",
             "shape": [2, -1], "partition_dim": 0},
        ],
    }  # fmt: skip


def build_fused_qkv_engine(
    tp: int = 2,
    zero_stage: int = 1,
    dtype: str = "fp32",
    seed: int = 0,
    num_layers: int = 2,
    **overrides: Any,
):
    """A tiny Phi-3 (``Phi3ForCausalLM``: fused ``qkv_proj``, grouped-query attention of 6
    query and 3 key/value heads of 8) split over ``tp`` ranks by AutoTP. On 2 ranks q, k and
    v are each cut on key/value-head boundaries, unevenly: ``sub_param_shard_widths``
    [[32, 16], [16, 8], [16, 8]]. Train it with ``train``."""
    from transformers import Phi3Config, Phi3ForCausalLM

    setup_single_process_env()
    import deepspeed

    deepspeed.init_distributed(dist_backend=None, verbose=False)
    heads, kv_heads, head_dim = 6, 3, 8
    rng_state = torch.get_rng_state()
    torch.manual_seed(seed)
    try:
        cfg = Phi3Config(
            vocab_size=128, hidden_size=heads * head_dim, intermediate_size=64, num_hidden_layers=num_layers,
            num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=256,
            tie_word_embeddings=False, attention_dropout=0.0, resid_pdrop=0.0, embd_pdrop=0.0,
            pad_token_id=0, bos_token_id=0, eos_token_id=0,
        )  # fmt: skip
        cfg._attn_implementation = "eager"
        module = Phi3ForCausalLM(cfg)
    finally:
        torch.set_rng_state(rng_state)
    module.train()
    if tp > 1:
        overrides.setdefault(
            "tensor_parallel",
            {"autotp_size": tp, "partition_config": _fused_qkv_partition_config(heads, kv_heads, head_dim)},
        )
    cfg_ds = ds_config(zero_stage, dtype, **overrides)
    engine, *_ = deepspeed.initialize(
        model=module, model_parameters=_param_groups(module, 0.01), config=cfg_ds
    )
    if tp > 1:
        # transformers' Phi3Attention finds where k starts in qkv_proj's output from the
        # config's num_attention_heads, which AutoTP leaves at the whole model's (it shards the
        # modules' own head counts): this rank's query heads, or its k and v come out empty.
        attention = engine.module.model.layers[0].self_attn
        local_rows = attention.qkv_proj.weight.shape[0] - 2 * attention.num_key_value_heads * head_dim
        engine.module.config.num_attention_heads = local_rows // head_dim
    return engine


def build_megatron_engine(
    tp: int = 2,
    zero_stage: int = 1,
    dtype: str = "fp32",
    seed: int = 0,
    num_layers: int = 2,
    **overrides: Any,
):
    """``tools/megatron_style.MLPStack`` split over ``tp`` tensor-parallel ranks by its own
    column- and row-parallel linears, handed to DeepSpeed with its ``mpu`` (the data parallel
    over the rest). Train it with ``train_megatron``; its client passes ``UNIVERSAL_INFO``."""
    setup_single_process_env()
    import deepspeed

    from tools.megatron_style import MLPStack, ModelParallelUnit

    deepspeed.init_distributed(dist_backend=None, verbose=False)
    mpu = ModelParallelUnit(tp)
    torch.manual_seed(seed)
    module = MLPStack(mpu, layers=num_layers)
    cfg = ds_config(zero_stage, dtype, **overrides)
    engine, *_ = deepspeed.initialize(
        model=module, model_parameters=_param_groups(module, 0.01), config=cfg, mpu=mpu
    )
    return engine


def train_megatron(engine, batch_list) -> list[float]:
    """One optimizer step per batch of ``build_megatron_engine``'s model; the losses."""
    losses = []
    for batch in batch_list:
        loss = engine(batch.to(engine.device))
        engine.backward(loss)
        engine.step()
        losses.append(float(loss.detach().float().item()))
    return losses


def train_pipeline(engine, batch_list) -> list[float]:
    """One ``train_batch`` per two batches (the engine's two micro-batches), each batch's
    labels its inputs shifted by one; returns the losses (every stage gets the last one's)."""
    losses = []
    for first in range(0, len(batch_list) - 1, 2):
        pairs = [(b, b.roll(-1, dims=1).reshape(-1)) for b in batch_list[first : first + 2]]
        losses.append(float(engine.train_batch(data_iter=iter(pairs)).float().item()))
    return losses


def add_bench_model_options(parser, *, hidden: int, layers: int, vocab: int, reps: int) -> None:
    """The benchmarks' model size and repetition options, with these defaults."""
    parser.add_argument("--hidden", type=int, default=hidden)
    parser.add_argument("--layers", type=int, default=layers)
    parser.add_argument("--vocab", type=int, default=vocab)
    parser.add_argument("--reps", type=int, default=reps)
    parser.add_argument(
        "--dtype", choices=("bf16", "fp16", "fp32"), default="bf16", help="training precision"
    )


def build_bench_engine(args, **options: Any) -> Any:
    """The benchmarks' engine: a Llama of the options' size, ZeRO-2, bf16 unless ``args.dtype``
    says (``options``: more of ``build_engine``'s, such as ``lr`` and ``scheduler``).

    On a GPU (``DS_ACCELERATOR`` other than cpu) the optimizer is torch's AdamW: FusedAdam's nvcc
    build would take minutes of a lent machine, and the optimizer does not change what a
    checkpoint holds (the same fp32 master weights and two moments per parameter).
    """
    overrides = {}
    if os.environ.get("DS_ACCELERATOR", "cpu") != "cpu":
        overrides["optimizer"] = {"params": {"torch_adam": True}}
    return build_engine(
        "llama",
        zero_stage=2,
        dtype=getattr(args, "dtype", "bf16"),
        seed=0,
        num_layers=args.layers,
        hidden=args.hidden,
        vocab=args.vocab,
        **overrides,
        **options,
    )


def batches(n: int, seed: int = 1234, vocab: int = 128, seq: int = 16, batch: int = 2) -> list[torch.Tensor]:
    """``n`` deterministic ``(batch, seq)`` int64 input_ids tensors (independent of global RNG)."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (batch, seq), generator=g, dtype=torch.long) for _ in range(n)]


def train(engine, batch_list) -> list[float]:
    """One optimizer step per batch (micro batch == batch); returns the losses as floats."""
    losses = []
    dev = engine.device
    for b in batch_list:
        b = b.to(dev)
        loss = engine(input_ids=b, labels=b).loss
        engine.backward(loss)
        engine.step()
        losses.append(float(loss.detach().float().item()))
    return losses


def destroy_engine(engine, collect: bool = True) -> None:
    """Release an engine's resources so that its memory is really freed. The process group is kept.

    Without this, ``del engine`` frees nothing: DeepSpeed's hooks form reference cycles that keep
    every engine alive (measured: +0.65 GB RSS per 20M-param bf16 ZeRO-2 engine, kept forever).
    ``engine.destroy()`` breaks them for ZeRO 0-2; ZeRO 3 additionally leaves the root module in the
    global ``deepspeed.runtime.zero.parameter_offload.FWD_MODULE_STACK`` (appended in
    DeepSpeedZeRoOffload.__init__, never popped), and once its parameter trace is complete (a few
    steps) a class-level ``functools.lru_cache`` on
    ``PartitionedParameterCoordinator.__params_to_release`` keys on the coordinator and submodules;
    both pin the whole engine, so both are cleared here (clearing the cache is harmless for other
    live engines: it is only recomputed).
    """
    module = getattr(engine, "module", None)
    model_parallel = getattr(engine, "mpu", None) is not None
    try:
        engine.destroy()
    finally:
        if model_parallel:  # an mpu (AutoTP's too) stays DeepSpeed's for every later engine otherwise
            from deepspeed.utils import groups

            groups._release_process_group_references()
        if module is not None:
            try:
                from deepspeed.runtime.zero import parameter_offload as _po

                _po.FWD_MODULE_STACK[:] = [m for m in _po.FWD_MODULE_STACK if m is not module]
            except Exception:  # pragma: no cover - other deepspeed versions
                pass
        _clear_zero3_release_cache()
        if collect:  # the engine is a web of cycles: only a full collection frees it (~0.3 s)
            gc.collect()


def _clear_zero3_release_cache() -> None:
    try:
        from deepspeed.runtime.zero.partitioned_param_coordinator import PartitionedParameterCoordinator
    except Exception:  # pragma: no cover
        return
    fn = PartitionedParameterCoordinator.__dict__.get("_PartitionedParameterCoordinator__params_to_release")
    # It is wrapped by instrument_w_nvtx (no functools.wraps): find the lru_cache wrapper inside.
    for _ in range(3):
        if fn is None:
            return
        if hasattr(fn, "cache_clear"):
            fn.cache_clear()
            return
        cells = [c.cell_contents for c in (getattr(fn, "__closure__", None) or ())]
        fn = next((c for c in cells if callable(c)), None)


def finalize_distributed() -> None:
    """Destroy the default process group if one exists. Safe to call more than once."""
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
    except Exception:  # pragma: no cover - best effort at shutdown
        pass


# Every process that builds an engine (tests, their workers under torchrun, the benches, the demo)
# imports this module first: each of them then loads DeepSpeed's ops without py-cpuinfo's
# subprocesses (``remember_cpu_info``).
remember_cpu_info()
