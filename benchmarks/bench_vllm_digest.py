"""What ``SAFEVIEW_DIGEST=sample:16`` adds to a request's transfer path on vLLM 0.33's NIXL
connector (issue 29), on CPU, with the P/D harness of tests/test_vllm_digest.py: P and D in
separate processes, the test relaying ``kv_transfer_params``.

Two P processes with the plugin, one with ``SAFEVIEW_DIGEST=sample:16`` and one with digests
off, each serve the same engine (Llama-like, 3 layers, 4 KV heads, 32-token blocks, a request
of 3 blocks) and finish ``--requests`` requests (``request_finished``, then P's next engine
step, as vLLM runs them: where P's ranks digest a sampled request); one D process
(``SAFEVIEW_DIGEST=sample:16``, strict) reads every request of both, alternating. A request's
transfer path: P's ``request_finished`` and next step, plus D's read until vLLM reports it
done (the READ, and for a sampled request D's digest, the fetch of P's digests from P's side
channel and the judgement). The figure: the mean of that time per request with sampling over
the mean without, in the same run. Target: at most 1.02 (2%).

D's harness polls ``get_transfer_results`` every 20 ms, as an engine steps; a sampled request
is judged in the step its READ is reported done when P's digests came during the READ (D asks
for them when the READ starts), else one step later.

Run: .venv-vllm/bin/python benchmarks/bench_vllm_digest.py [--requests 64]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from dataclasses import asdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

import vllm_across_harness as harness  # type: ignore[import-not-found,unused-ignore]

TARGET = 1.02


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=64, help="requests per P (>= 16)")
    args = parser.parse_args()
    engine = harness.Engine()
    blocks = [1, 2, 3]
    models = harness.write_models(Path(tempfile.mkdtemp(prefix="safeview-models-")))
    p_on = harness.Child("P", models, {"SAFEVIEW_DIGEST": "sample:16"})
    p_off = harness.Child("P", models)
    d = harness.Child("D", models, {"SAFEVIEW_DIGEST": "sample:16"})
    children = [p_on, p_off, d]
    try:
        answer = d.call({"op": "start", "name": "D1", "engine": asdict(engine), "policy": "strict"})
        assert answer["error"] is None, answer
        served, finished = {}, {}
        for key, child in (("on", p_on), ("off", p_off)):
            served[key] = child.call(
                {"op": "serve", "name": key, "engine": asdict(engine),
                 "port": harness.free_port(), "remote_blocks": blocks, "seed": 1}
            )  # fmt: skip
            assert served[key]["error"] is None, served[key]
            finished[key] = child.call(
                {"op": "finish", "name": key, "engine": asdict(engine), "remote_blocks": blocks,
                 "count": args.requests}
            )  # fmt: skip
            assert finished[key]["error"] is None, finished[key]
        # the first read of each P does the handshake: not a request's steady cost
        for key in ("on", "off"):
            d.call({"op": "read", "name": "D1", "p": asdict(engine), "tag": f"warm-{key}",
                    "kv_transfer_params": served[key]["kv_transfer_params"],
                    "caches": served[key]["caches"]})  # fmt: skip
        times: dict[str, list[float]] = {"on": [], "off": []}
        verdicts: list[str] = []
        for at in range(args.requests):
            for key in ("on", "off") if at % 2 == 0 else ("off", "on"):
                params = finished[key]["kv_transfer_params"][at]
                read = d.call(
                    {"op": "read", "name": "D1", "p": asdict(engine), "tag": f"{key}-{at}",
                     "kv_transfer_params": params, "caches": served[key]["caches"]}
                )  # fmt: skip
                assert read["error"] is None, read
                [outcome] = read["reads"]
                assert (outcome["done"], outcome["failed"]) == (True, False), outcome
                assert outcome["oracle"]["ok"]
                times[key].append(finished[key]["seconds"][at] + outcome["seconds"])
                verdicts += [
                    e["verdict"] for e in read["events"] if e["event"].startswith("digest")
                ]
    finally:
        for child in children:
            child.exit()
    sampled = sum(
        1 for params in finished["on"]["kv_transfer_params"] if "safeview_digest" in params
    )
    on, off = statistics.mean(times["on"]), statistics.mean(times["off"])
    ratio = on / off
    p_on_s = statistics.mean(finished["on"]["seconds"])
    p_off_s = statistics.mean(finished["off"]["seconds"])
    agree = verdicts.count("agree")
    print(f"{args.requests} requests per P, {sampled} of P(sample:16)'s digested and judged "
          f"({agree} agree, {len(verdicts) - agree} other)")  # fmt: skip
    print(f"P's request_finished + next step, mean: {p_on_s * 1e3:.2f} ms (sample:16), "
          f"{p_off_s * 1e3:.2f} ms (off)")  # fmt: skip
    print(f"transfer path per request, mean: {on * 1e3:.1f} ms (sample:16), {off * 1e3:.1f} ms "
          f"(off): ratio {ratio:.3f}")  # fmt: skip
    verdict = "PASS" if ratio <= TARGET else "FAIL"
    print(
        f"{verdict}: sample:16 adds {100 * (ratio - 1):+.1f}% (target <= {100 * (TARGET - 1):.0f}%)"
    )
    return 0 if verdict == "PASS" else 1


if __name__ == "__main__":
    sys.exit(main())
