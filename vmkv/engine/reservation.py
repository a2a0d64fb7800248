"""Static KV reservation at admission: the Orca baselines of the PagedAttention paper (Kwon et al.,
SOSP'23, section 6.1; its artifact's Orca block manager), as an admission policy over either backend.

Under a reservation policy the scheduler backs, when it admits a sequence, every position the sequence
can ever need, ``min(prompt_len + estimate, max_model_len)``, and never extends it afterwards, so it
never needs more memory and never preempts (a request that does not fit waits in FCFS order).  The
estimate of the output length is

- ``oracle``: the true output length (the request's ``max_tokens``; benchmark workloads use
  ``ignore_eos``, so it is exact);
- ``pow2``: the next power of two of it (an estimator that over-reserves up to 2x);
- ``max``: ``max_model_len`` (no knowledge of the output length at all);

and ``none`` (the default) turns reservation off: KV grows on demand, one unit at a time, and the newest
sequence is preempted when the cache is full (paged: vLLM; vmem: vAttention).  A request without
``max_tokens`` reserves ``max_model_len`` under every policy.  So ``--backend paged --kv-reservation
max`` is "Orca (Max)" on PagedAttention's blocks and kernels, and ``--backend vmem --kv-reservation
max`` the same on vmem pages: the comparison isolates the memory policy.

Pure functions of counts, no state: the scheduler owns what is reserved (the backed positions are
the cache's ``seq_len``).
"""

from __future__ import annotations

__all__ = ["KV_RESERVATIONS", "check_reservation", "output_estimate", "reserved_tokens", "design_label",
           "parse_design", "design_options"]

#: ``--kv-reservation`` values, ``"none"`` (no reservation) first
KV_RESERVATIONS = ("none", "oracle", "pow2", "max")


def check_reservation(value: object, owner: str = "kv_reservation") -> str:
    """``value`` if it is a :data:`KV_RESERVATIONS` name.  Raises ValueError naming the choices."""
    if value not in KV_RESERVATIONS:
        raise ValueError(f"{owner} must be one of {list(KV_RESERVATIONS)}, got {value!r}")
    return value  # type: ignore[return-value]


def output_estimate(policy: str, max_tokens: int | None, max_model_len: int) -> int:
    """The output length ``policy`` reserves for (tokens, >= 1): ``max_tokens`` (oracle), its next
    power of two (pow2), or ``max_model_len`` (max, or no ``max_tokens``)."""
    if policy == "max" or max_tokens is None:
        return max_model_len
    if policy == "oracle":
        return max(1, max_tokens)
    if policy == "pow2":
        return 1 << max(0, max_tokens - 1).bit_length()
    raise ValueError(f"no output estimate under kv_reservation {policy!r}; choose from {list(KV_RESERVATIONS[1:])}")


def reserved_tokens(policy: str, prompt_len: int, max_tokens: int | None, max_model_len: int) -> int | None:
    """Positions a sequence reserves at admission: ``min(prompt_len + estimate, max_model_len)``
    (:func:`output_estimate`), or ``None`` under ``"none"`` (it grows on demand)."""
    if policy == "none":
        return None
    return min(prompt_len + output_estimate(policy, max_tokens, max_model_len), max_model_len)


def design_label(backend: str, policy: str) -> str:
    """The name of a KV design in comparison tables: the backend, ``+policy`` under reservation
    (``"paged"``, ``"paged+max"``, ``"vmem+oracle"``)."""
    return backend if policy == "none" else f"{backend}+{policy}"


def parse_design(label: str) -> tuple[str, str]:
    """``"paged+max"`` -> ``("paged", "max")``; ``"vmem"`` -> ``("vmem", "none")``; a variant's option
    values (``"vmem@kv_shrink_grace_s=inf"``: :func:`design_options`) are not part of it.  Raises
    ValueError for an unknown policy (the backend is checked by the caller)."""
    backend, _, policy = label.split("@", 1)[0].partition("+")
    return backend, check_reservation(policy or "none", f"the reservation of {label!r}")


def design_options(label: str) -> dict[str, str]:
    """The backend-option values a design variant sets, as text: ``"vmem@kv_shrink_grace_s=inf"`` ->
    ``{"kv_shrink_grace_s": "inf"}`` (``@`` before each ``name=value``; ``{}`` for a plain design), so
    one comparison can run a backend twice with one option changed.  Raises ValueError: a part is not
    ``name=value``."""
    out: dict[str, str] = {}
    for part in label.split("@")[1:]:
        name, eq, value = part.partition("=")
        if not eq or not name.strip() or not value.strip():
            raise ValueError(f"design {label!r}: {part!r} is not name=value (e.g. vmem@kv_shrink_grace_s=inf)")
        out[name.strip().replace("-", "_")] = value.strip()
    return out
