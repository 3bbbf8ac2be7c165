"""Where an offload strategy trains a model's embeddings, output head and vectors: the strategies' ``embeddings``,
``head`` and ``vectors``.

At a 1.3B LLaMA shape the input embedding and the untied LM head are 131M of the 207M elements a dense host path
steps each step, and most of the link bytes. These settings move them off that path:

* ``embeddings``: ``"host"`` (dense host Adam, exact), ``"sparse"`` (only the rows of the batch's tokens cross and
  are stepped, by :class:`~lightning_offload.engine.rows.block_row_adam.BlockRowAdam`), ``"device"`` (a device Adam; its
  state costs device memory) or ``"frozen"``.
* ``head``: ``"host"``, ``"projected"`` (compressed by LSP projectors like any Linear), ``"device"`` or
  ``"frozen"``. By default a strategy that projects puts a head by its size: ``"projected"`` from
  :data:`PROJECTED_HEAD_ELEMENTS` elements on (today's 128K–256K vocabularies: Llama-3.2-1B's tied head has 262M,
  Llama-3.1-8B's 525M, whose dense host state and speculation backups alone would be 14.7 GiB), else ``"host"``
  (SmolLM2's 28M; projecting a head cost a fifth of AdamW's gain on the measured small models).
* ``vectors``: the 1-D (and 0-D) parameters, norm weights and biases: ``"device"`` (a device Adam) or ``"host"``. Each
  host-stepped tensor costs the step a fixed share of engine work (its hook, its crossing, its launch and its host
  job: ~0.15 ms on a 2-core CPU whatever its size), most of a norm's step, while their state on the device is at most
  12 bytes an element (about 3 MB for all of Llama-3.1-8B's 266K). By default they stay on the device.

Embeddings are the model's ``nn.Embedding`` modules (token and learned position embeddings); the head is what
:func:`~lightning_offload.lsp.output_heads.output_heads` finds: what Hugging Face's ``get_output_embeddings``
returns (through PEFT's wrappers), else the layer mapping hidden features to an embedding's vocabulary. Task heads
(classifiers) are small and always stay on the host. A weight tied between the input embedding and the head is one
parameter whose gradient is dense in every row (the head's share), so it takes the ``head`` setting.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass, field

from torch import Tensor, nn

from lightning_offload.engine.settings import (  # noqa: F401  (the placements' names, re-exported)
    EMBEDDING_PLACEMENTS, HEAD_PLACEMENTS, VECTOR_PLACEMENTS, validate_placements)
from lightning_offload.lsp.output_heads import output_heads

#: The default head placement of a strategy that projects (``head=None``): each head's by its size.
HEAD_BY_SIZE = "by size"
#: Elements from which ``head=None`` projects a head (2**27, 134M: at ~30 host bytes an element, its dense state and
#: speculation backup would be 3.75 GiB, and its host Adam the step's floor on a GPU).
PROJECTED_HEAD_ELEMENTS = 2**27


@dataclass
class Placement:
    """Which trainable parameters leave the dense host path, and how.

    Attributes:
        device: stepped by a device Adam.
        row_sparse: embedding weights stepped row-sparsely on the host.
        frozen: not trained while the strategy runs (``requires_grad`` restored at teardown).
        projected_heads: head modules to project, by qualified name.
        tied_projected: identities of projected head weights also used by an embedding lookup (their lookup's
            gradient is compressed into the head's ``S`` as well).
        messages: what was decided, one line each, for the log.
        warnings: settings the user gave that apply to nothing, one line each.
    """

    device: list[Tensor] = field(default_factory=list)
    row_sparse: list[Tensor] = field(default_factory=list)
    frozen: list[Tensor] = field(default_factory=list)
    projected_heads: dict[str, nn.Module] = field(default_factory=dict)
    tied_projected: set[int] = field(default_factory=set)
    messages: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)


def plan_placement(model: nn.Module, trained: set[int], embeddings: str, head: str,
                   dense_reasons: Mapping[int, str] | None = None, vectors: str = "host",
                   explicit: Collection[str] = ()) -> Placement:
    """Decide where ``model``'s embeddings, output head and vectors train.

    Args:
        model: the LightningModule (or any module holding the network).
        trained: identities of the parameters the user's optimizer trains (others are left alone).
        embeddings: see the module docstring.
        head: see the module docstring.
        dense_reasons: embeddings that ``embeddings="sparse"`` steps densely on the host instead, by identity, each
            with the reason said in the log (the row step cannot follow their param group's settings).
        vectors: see the module docstring. Default: ``"host"``.
        explicit: which of ``"embeddings"`` and ``"head"`` the user set (not the strategy's default): one that finds
            nothing to apply to is a warning. Default: neither.
    """
    dense_reasons = dense_reasons or {}
    validate_placements(embeddings, "host" if head == HEAD_BY_SIZE else head, vectors)  # no user's value: by size
    plan = Placement()
    heads: dict[int, tuple[str, nn.Module]] = {}
    for found in output_heads(model).values():
        weight = found.module.weight
        if weight.requires_grad and id(weight) in trained:
            heads.setdefault(id(weight), (found.name, found.module))
    embedding_weights = {id(m.weight): name for name, m in model.named_modules()
                         if isinstance(m, nn.Embedding) and m.weight.requires_grad and id(m.weight) in trained}
    asked = head
    for weight_id, (name, module) in heads.items():
        head = _by_size(name, module.weight, plan) if asked == HEAD_BY_SIZE else asked
        tied = weight_id in embedding_weights
        if tied:
            plan.messages.append(f"{name}.weight is tied to the input embedding {embedding_weights[weight_id]}: it "
                                 f"takes head={head!r} (its gradient is dense in every row).")
        if head == "projected":
            plan.projected_heads[name] = module
            if tied:
                plan.tied_projected.add(weight_id)
        elif head == "device":
            plan.device.append(module.weight)
            plan.messages.append(f"{name}.weight is stepped by an Adam on the device (head='device').")
        elif head == "frozen":
            plan.frozen.append(module.weight)
            plan.messages.append(f"{name}.weight is frozen while training (head='frozen').")
        elif head == "host":
            why = (f"head=None keeps a head under {PROJECTED_HEAD_ELEMENTS / 1e6:.0f}M elements dense"
                   if asked == HEAD_BY_SIZE else "head='host'")
            plan.messages.append(f"{name}.weight is the output head: stepped densely on the host ({why}).")
    by_id = {id(p): p for p in model.parameters()}
    for weight_id, name in embedding_weights.items():
        if weight_id in heads:
            continue
        weight = by_id[weight_id]
        if embeddings == "sparse" and weight_id in dense_reasons:
            plan.messages.append(f"{name}.weight is stepped densely on the host (embeddings='host'): its param group "
                                 f"{dense_reasons[weight_id]}.")
        elif embeddings == "sparse":
            plan.row_sparse.append(weight)
            plan.messages.append(f"{name}.weight is stepped row-sparsely (embeddings='sparse'): only the rows of each "
                                 f"batch's tokens cross and are updated; embeddings='host' steps every row.")
        elif embeddings == "device":
            plan.device.append(weight)
            plan.messages.append(f"{name}.weight is stepped by an Adam on the device (embeddings='device').")
        elif embeddings == "frozen":
            plan.frozen.append(weight)
            plan.messages.append(f"{name}.weight is frozen while training (embeddings='frozen').")
    if vectors == "device":
        _vectors_on_device(model, trained, plan)
    # A placement the user asked for that applies to nothing is a warning: the setting has no effect.
    if "embeddings" in explicit and not any(w not in heads for w in embedding_weights):
        tied = [name for weight_id, name in embedding_weights.items() if weight_id in heads]
        plan.warnings.append(f"embeddings={embeddings!r} has no effect: "
                             + (f"the model's trainable embedding {', '.join(tied)} is tied to the output head and "
                                f"takes head={asked if asked != HEAD_BY_SIZE else None!r}." if tied else
                                "the model has no trainable nn.Embedding to apply it to."))
    if "head" in explicit and not heads:
        plan.warnings.append(f"head={asked!r} found no trainable output head to apply to (none is returned by a "
                             f"get_output_embeddings() nor maps hidden features to an nn.Embedding's vocabulary): the "
                             f"setting has no effect. Place a head of another kind by name with "
                             f"target_modules/exclude_modules.")
    return plan


def _vectors_on_device(model: nn.Module, trained: set[int], plan: Placement) -> None:
    """Put the trainable 1-D and 0-D parameters of the user's groups on the device Adam, said in one line."""
    placed = {id(p) for p in plan.device + plan.frozen + plan.row_sparse}
    names = [name for name, p in model.named_parameters()
             if p.dim() <= 1 and p.requires_grad and id(p) in trained and id(p) not in placed]
    by_name = dict(model.named_parameters())
    plan.device += [by_name[name] for name in names]
    if names:
        elements = sum(by_name[name].numel() for name in names)
        shown = ", ".join(names[:3]) + (", …" if len(names) > 3 else "")
        state = elements * 12  # at most: two fp32 moments, and an fp32 master beside a bf16 weight
        size = f"{state / 2**20:.1f} MiB" if state >= 2**20 else f"{state / 2**10:.1f} KiB"
        plan.messages.append(f"{len(names)} vectors ({shown}; {elements:,} elements) are stepped by an Adam on the "
                             f"device (vectors='device': ≤ {size} of device state, no host job each); vectors='host' "
                             f"steps them on the host.")


def _by_size(name: str, weight: Tensor, plan: Placement) -> str:
    """The default placement of one head: projected when it is large (said in the log), else on the host."""
    if weight.numel() < PROJECTED_HEAD_ELEMENTS:
        return "host"
    plan.messages.append(f"{name}.weight has {weight.numel() / 1e6:.0f}M elements: it is projected (head=None "
                         f"projects a head of {PROJECTED_HEAD_ELEMENTS / 1e6:.0f}M elements or more, whose dense host "
                         f"state would be ~{weight.numel() * 30 / 2**30:.1f} GiB with speculation); head='host' keeps "
                         f"it dense.")
    return "projected"
