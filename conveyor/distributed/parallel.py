"""Tensor parallelism: one rank's share of the model, and the collectives between the ranks.

The Llama family splits Megatron-style across N ranks:

  qkv_proj, gate_up_proj  column-parallel: a rank holds the rows of its query heads, of the
                          key/value heads they read, and of its slice of the MLP;
  o_proj, down_proj       row-parallel: a rank multiplies its columns into a partial sum, and
                          one all-reduce per projection adds the partial sums up;
  embed_tokens, lm_head   vocabulary-parallel: a rank holds ceil(V / N) rows of the vocabulary
                          (the last one padded with zeros); an id outside its rows embeds as
                          zeros, so an all-reduce completes the embedding; each rank computes
                          the logits of its rows, and an all-gather hands the sampler all of them.

Norms, rotary tables and biases of the row-parallel projections (none in this family) are
replicated. Latent attention (model/mla.py) splits by query heads too: q_proj / q_b_proj and
kv_b_proj by their heads' rows, o_proj by their columns; its latent projections, and the latent
cache they fill, are every rank's (as vLLM's MLA). With fewer key/value heads than ranks (MQA,
or GQA with N > its KV heads), each KV head is replicated on the N / num_kv_heads ranks whose
query heads read it, as in vLLM. Each rank's KV cache holds only its own KV heads.
"""

from __future__ import annotations

import datetime
import socket
from dataclasses import dataclass

import torch

DEFAULT_TIMEOUT = 60.0  # seconds a collective may wait for a rank before it fails
LOOPBACK = "127.0.0.1"  # a tensor-parallel group spans one machine


@dataclass(frozen=True, slots=True)
class TPShard:
    """Which part of the model one rank holds: rank `rank` of `size`."""

    rank: int = 0
    size: int = 1

    def heads(self, num_heads: int) -> tuple[int, int]:
        """(first, count) of this rank's query heads."""
        count = num_heads // self.size
        return self.rank * count, count

    def kv_heads(self, num_kv_heads: int) -> tuple[int, int]:
        """(first, count) of the key/value heads this rank's query heads read."""
        if num_kv_heads >= self.size:
            count = num_kv_heads // self.size
            return self.rank * count, count
        return self.rank * num_kv_heads // self.size, 1  # replicated

    def part(self, total: int) -> tuple[int, int]:
        """(first, count) of an evenly divided dimension (the MLP's intermediate size)."""
        count = total // self.size
        return self.rank * count, count

    def vocab(self, vocab_size: int) -> tuple[int, int, int]:
        """(first, stop, rows): this rank's vocabulary rows [first, stop), held in `rows`
        rows (the last rank's padded with zeros to the others' count)."""
        rows = -(-vocab_size // self.size)
        first = min(self.rank * rows, vocab_size)
        return first, min(first + rows, vocab_size), rows

    def slice_of(self, name: str, cfg) -> tuple[int, int, int, int] | None:
        """How a checkpoint tensor (by its transformers name) is cut for this rank:
        (dim, start, stop, padded length along dim), or None for a replicated tensor."""
        if self.size == 1:
            return None
        leaf = name.rsplit(".", 2)
        module, param = (leaf[-2], leaf[-1]) if len(leaf) >= 2 else ("", name)
        parts = getattr(cfg, "parts", None)
        if parts is not None and parts.mla and module in _LATENT_HEADS:
            return self._latent_slice(module, param, cfg)
        d = cfg.head_dim
        if module == "q_proj":
            first, count = self.heads(cfg.num_heads)
            return 0, first * d, (first + count) * d, count * d
        if module in ("k_proj", "v_proj"):
            first, count = self.kv_heads(cfg.num_kv_heads)
            return 0, first * d, (first + count) * d, count * d
        if module == "o_proj" and param == "weight":
            first, count = self.heads(cfg.num_heads)
            return 1, first * d, (first + count) * d, count * d
        if module in ("gate_proj", "up_proj"):
            first, count = self.part(_intermediate_size(name, cfg))
            return 0, first, first + count, count
        if module == "down_proj" and param == "weight":
            first, count = self.part(_intermediate_size(name, cfg))
            return 1, first, first + count, count
        if module in ("embed_tokens", "lm_head"):
            first, stop, rows = self.vocab(cfg.vocab_size)
            return 0, first, stop, rows
        return None

    def _latent_slice(self, module: str, param: str, cfg) -> tuple[int, int, int, int] | None:
        """Latent attention (model/mla.py): a rank holds its heads' rows of q_proj / q_b_proj
        and kv_b_proj and their columns of o_proj; the latent projections (q_a_proj,
        kv_a_proj_with_mqa) and their norms are every rank's, and so is the latent cache."""
        _, _, nope, rope, v_dim = cfg.parts.mla
        per_head = {"q_proj": nope + rope, "q_b_proj": nope + rope, "kv_b_proj": nope + v_dim}
        first, count = self.heads(cfg.num_heads)
        if module == "o_proj":
            return None if param != "weight" else (1, first * v_dim, (first + count) * v_dim,
                                                    count * v_dim)  # fmt: skip
        d = per_head[module]
        return 0, first * d, (first + count) * d, count * d


# Latent attention's tensors cut by head (TPShard._latent_slice).
_LATENT_HEADS = ("q_proj", "q_b_proj", "kv_b_proj", "o_proj")


def _intermediate_size(name: str, cfg) -> int:
    """The intermediate size of the MLP a gate/up/down tensor belongs to: a dense layer's, an
    expert's (each expert split like a dense MLP), or Qwen2-MoE's shared expert's."""
    if ".shared_expert." in name:
        return cfg.parts.shared_expert_size
    if ".experts." in name:
        return cfg.parts.moe_intermediate_size
    return cfg.intermediate_size


def check_tensor_parallel(cfg, size: int) -> None:
    """Refuses, with the reason, a model that does not split over `size` ranks."""
    if size < 1:
        raise ValueError(f"tensor_parallel_size must be >= 1, got {size}")
    if size == 1:
        return
    parts = getattr(cfg, "parts", None)
    problems = []
    if cfg.num_heads % size:
        problems.append(f"its {cfg.num_heads} attention heads")
    kv = cfg.num_kv_heads
    if (kv >= size and kv % size) or (kv < size and size % kv):
        problems.append(f"its {kv} key/value heads (nor does {size} divide by them)")
    if cfg.intermediate_size % size:
        problems.append(f"its MLP's intermediate size {cfg.intermediate_size}")
    for what, inner in (
        ("experts'", "moe_intermediate_size"),
        ("shared expert's", "shared_expert_size"),
    ):
        if parts is not None and getattr(parts, inner) % size:
            problems.append(f"its {what} intermediate size {getattr(parts, inner)}")
    if parts is not None and (parts.o_bias or parts.expert_bias or parts.attn_sinks):
        problems.append("its biased row-parallel projections and attention sinks (GPT-OSS)")
    if parts is not None and parts.qk_norm == "full":  # OLMo 2: one norm over every head
        problems.append("its q/k norms over all heads at once")
    if parts is not None and parts.family == "gemma4":
        problems.append("Gemma 4's per-layer heads, shared caches and per-layer inputs")
    if parts is not None and parts.family == "gemma3n":
        problems.append("Gemma 3n's AltUp streams, shared caches and per-layer inputs")
    if problems:
        raise ValueError(
            f"tensor_parallel_size={size} does not divide {' or '.join(problems)}; "
            "choose a size that divides the head counts"
        )


class TPGroup:
    """This rank's shard and its collectives. A single rank (`TPGroup()`) has no process
    group and its collectives return their input as is."""

    def __init__(self, shard: TPShard | None = None, process_group=None, shm=None) -> None:
        """shm: shared-memory collectives (distributed/shm.py) for ranks on one CPU node,
        used for every tensor that fits; the process group carries the rest."""
        self.shard = shard or TPShard()
        self.pg = process_group
        self.shm = shm

    @property
    def size(self) -> int:
        return self.shard.size

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """The sum over ranks (in place where `tensor` is contiguous)."""
        if self.pg is not None:
            tensor = tensor.contiguous()  # a CPU projection may return a transposed view
            if self.shm is not None and self.shm.fits(tensor):
                return self.shm.all_reduce(tensor)
            self.pg.allreduce([tensor]).wait()
        return tensor

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        """The ranks' tensors side by side along the last dimension (rank order)."""
        if self.pg is None:
            return tensor
        tensor = tensor.contiguous()
        if self.shm is not None and self.shm.fits(tensor):
            return self.shm.all_gather(tensor)
        parts = [torch.empty_like(tensor) for _ in range(self.size)]
        self.pg.allgather([parts], [tensor]).wait()
        return torch.cat(parts, dim=-1)


def serve_store(host: str, size: int, timeout: float = DEFAULT_TIMEOUT):
    """Rank 0's TCPStore, listening on `host` alone, on a free port (read it from `.port`);
    the other ranks find each other through it. The socket is bound here: given only a
    host name, TCPStore listens on every interface."""
    import torch.distributed as dist

    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        listener.bind((host, 0))
        listener.listen(max(size, 16))
        port = listener.getsockname()[1]
    except BaseException:
        listener.close()
        raise
    wait = datetime.timedelta(seconds=timeout)
    return dist.TCPStore(
        host,
        port,
        size,
        True,
        timeout=wait,
        wait_for_workers=False,
        master_listen_fd=listener.detach(),
    )


def connect(
    shard: TPShard,
    device: torch.device,
    *,
    store=None,
    address: tuple[str, int] | None = None,
    timeout: float = DEFAULT_TIMEOUT,
    shm_path: str | None = None,
    join_timeout: float | None = None,
) -> TPGroup:
    """Joins the ranks' process group, gloo on CPU and NCCL on CUDA: rank 0 with the store it
    serves, the others with that store's address. The group is an object of its own (not
    torch.distributed's global default group), so that an engine in a user's process leaves
    no global state behind. Every collective fails after `timeout` seconds without its
    peers: a rank that died or hangs takes the engine down with an error, never a hang.
    shm_path: the shared file of the CPU collectives (distributed/shm.py), if any.
    join_timeout: how long joining may wait for the other ranks (default `timeout`): a worker
    joins as soon as it starts, rank 0 only once it has loaded its share of the model."""
    import torch.distributed as dist

    wait = datetime.timedelta(seconds=timeout)
    join = datetime.timedelta(seconds=max(timeout, join_timeout or 0))
    if store is None:
        host, port = address
        store = dist.TCPStore(host, port, shard.size, False, timeout=join)
    prefixed = dist.PrefixStore("conveyor-tp", store)
    if device.type == "cuda":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = wait
        pg = dist.ProcessGroupNCCL(prefixed, shard.rank, shard.size, options)
    else:
        options = dist.ProcessGroupGloo._Options()
        options._timeout = join
        # The ranks share one machine: gloo's pairs listen on loopback, not on the address
        # the host name resolves to.
        options._devices = [dist.ProcessGroupGloo.create_device(hostname=LOOPBACK)]
        options._threads = 2
        pg = dist.ProcessGroupGloo(prefixed, shard.rank, shard.size, options)
        pg._set_default_timeout(wait)  # joined: a collective waits `timeout` at most
    shm = None
    if shm_path is not None:
        from conveyor.distributed.shm import ShmCollectives

        shm = ShmCollectives(shm_path, shard.rank, shard.size, timeout)
    return TPGroup(shard, pg, shm)
