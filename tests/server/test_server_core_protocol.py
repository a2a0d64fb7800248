"""The engine core's wire format: the per-step message encoded from the engine's tuples is byte for byte
the typed ``StepOutputs`` message, and every message type survives a round trip."""

from __future__ import annotations

import random

from vmkv.engine.sampling_params import RequestOutputKind, SamplingParams
from vmkv.server import core_protocol as proto


def _random_deltas(rng: random.Random) -> list[tuple]:
    out = []
    for i in range(rng.randint(0, 40)):
        comps = [(j, [rng.randint(0, 200_000) for _ in range(rng.randint(0, 3))],
                  rng.choice([None, "stop", "length", "abort", "error"]), rng.choice([None, "STOP\u00e9", 7]))
                 for j in range(rng.randint(0, 3))]
        out.append((f"cmpl-{rng.getrandbits(64):x}-{i}", comps, rng.random() < 0.3, rng.randint(0, 4096),
                    rng.choice([None, "request r failed in sampling: RuntimeError: x"])))
    return out


def test_step_outputs_from_tuples_equal_the_typed_message():
    rng = random.Random(0)
    for _ in range(200):
        deltas = _random_deltas(rng)
        typed = proto.StepOutputs([proto.RequestDelta(rid, [proto.CompletionDelta(*c) for c in comps], fin, cached, err)
                                   for rid, comps, fin, cached, err in deltas])
        raw = proto.encode_step_outputs(deltas)
        assert raw == proto.encoder.encode(typed)
        assert proto.from_core_decoder.decode(raw) == typed


def test_every_message_round_trips():
    sp = SamplingParams(n=2, temperature=0.7, seed=3, max_tokens=9, stop_token_ids=[4], detokenize=False,
                        output_kind=RequestOutputKind.DELTA)
    to_core = [proto.AddRequest("r1", [1, 2, 3], sp, 12.5, "salt"), proto.Abort(["a", "b"]),
               proto.FinishSequences([("r1", 1, "STOP")]), proto.Utility(7, b"\x00\x01"), proto.Shutdown()]
    for msg in to_core:
        assert proto.to_core_decoder.decode(proto.encoder.encode(msg)) == msg
    from_core = [proto.Ready(b"x"), proto.StartupFailed("bad", "config"), proto.Rejected("r", "no", "n"),
                 proto.UtilityResult(3, True, b"y"), proto.EngineFailed("boom"),
                 proto.StepOutputs([proto.RequestDelta("r", [proto.CompletionDelta(0, [5], "length", None)], True)])]
    for msg in from_core:
        assert proto.from_core_decoder.decode(proto.encoder.encode(msg)) == msg
