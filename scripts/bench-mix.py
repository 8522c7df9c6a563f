#!/usr/bin/env python3
"""Request bodies for scripts/bench-decisions.sh: the same questions for probity's
/v1/decide and for cedar-agent's /v1/is_authorized, one JSON body per line.

    python3 scripts/bench-mix.py OUT_DIR [REQUESTS=200000]

Writes, for `probity` and `agent`:

- `<side>-mix.ndjson`: the realistic mix, in this proportion per 20 requests:
  - 10 admission reviews (50%): each Deployment's 8 replicas arrive one after another
    with the same pod template, so its workload (request-scoped, named after its facts
    as the webhook names it: `pod-<hash>`) asks `admit` of its namespace 8 times; every
    Deployment is a template of its own (a new image tag), so 1 in 8 is new.
  - 6 node agents' `comply` (30%): every node of the cluster, in turn, asking about
    itself with no readings (its facts are in the store).
  - 4 readers' `read` decisions (20%): the ranks of a job on a node reading the same
    checkpoint, verified (the context a reporter supplies).
- `<side>-unique.ndjson`: `schedule` questions that never repeat, each with a
  request-scoped workload of its own (`u-<n>`, its GPU count varying), on the nodes of
  testdata/entities/cluster.json in turn.
- `probity-twice.ndjson`: the same questions, each asked twice in a row (so the cache
  stores it) and never again: the memory soak's load, which fills the cache.

The cedar-agent side gets the same principal, action, resource and context, the
request's entities as `additional_entities`; its store (`agent-data.json`) is the
cluster with each node's `blocked` attribute (probity's blocklist owns it) and the
configuration entities probity serves (`config-entities.jsonl`, fetched by the runner).
"""

import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
IMAGE = "nvcr.io/nvidia/cuda:12.8.0-base-ubuntu24.04"


def entity(t, i):
    return {"__entity": {"type": t, "id": i}}


def workload(wid, namespace, gpus, image, cls="training"):
    return {
        "uid": {"type": "Workload", "id": wid},
        "attrs": {
            "namespace": entity("Namespace", namespace),
            "namespaceMatches": [namespace],
            "class": cls,
            "gpus": gpus,
            "cpuMillis": 8000 * max(gpus, 1),
            "gpuMemoryMiB": 0,
            "image": image,
            "tolerations": [],
        },
        "parents": [{"type": "Namespace", "id": namespace}],
    }


def both(principal, action, resource, context=None, entities=None):
    """The question as probity's /v1/decide body and as cedar-agent's."""
    p = {"principal": principal, "action": action, "resource": resource}
    a = {"principal": principal, "action": f'Action::"{action}"', "resource": resource,
         "context": context or {}}
    if context:
        p["context"] = context
    if entities:
        p["entities"] = entities
        a["additional_entities"] = entities
    return json.dumps(p, separators=(",", ":")), json.dumps(a, separators=(",", ":"))


def main():
    out = Path(sys.argv[1])
    total = int(sys.argv[2]) if len(sys.argv) > 2 else 200_000
    cluster = json.loads((REPO / "testdata/entities/cluster.json").read_text())
    nodes = [e["uid"]["id"] for e in cluster if e["uid"]["type"] == "Node"]
    checkpoints = [e["uid"]["id"] for e in cluster if e["uid"]["type"] == "Checkpoint"]
    namespaces = [e["uid"]["id"] for e in cluster if e["uid"]["type"] == "Namespace"]

    mix_p, mix_a = [], []
    deployment = 0
    replica = 8
    comply_at = read_at = 0
    for n in range(total):
        slot = n % 20
        if slot < 10:
            if replica == 8:
                deployment += 1
                replica = 0
                ns = namespaces[deployment % len(namespaces)]
                gpus = 1 + deployment % 4
                tag = f"{IMAGE}-d{deployment}"
            replica += 1
            # The webhook names a pod's workload after its facts: the same for every
            # replica of one template.
            wid = f"pod-{deployment:016x}"
            p, a = both(f'Workload::"{wid}"', "admit", f'Namespace::"{ns}"',
                        entities=[workload(wid, ns, gpus, tag)])
        elif slot < 16:
            node = nodes[comply_at % len(nodes)]
            comply_at += 1
            p, a = both(f'Node::"{node}"', "comply", f'Node::"{node}"')
        else:
            node = nodes[(read_at // 8) % len(nodes)]
            read_at += 1
            p, a = both(f'Node::"{node}"', "read", f'Checkpoint::"{checkpoints[0]}"',
                        context={"verified": True})
        mix_p.append(p)
        mix_a.append(a)

    uniq_p, uniq_a = [], []
    for n in range(total):
        wid = f"u-{n}"
        ns = namespaces[n % len(namespaces)]
        p, a = both(f'Workload::"{wid}"', "schedule", f'Node::"{nodes[n % len(nodes)]}"',
                    entities=[workload(wid, ns, 1 + n % 8, IMAGE)])
        uniq_p.append(p)
        uniq_a.append(a)

    # For the memory soak: each never-repeating question asked twice in a row (so the
    # cache stores it) and never again.
    twice = [line for line in uniq_p for _ in range(2)]
    for name, lines in [("probity-mix", mix_p), ("agent-mix", mix_a),
                        ("probity-unique", uniq_p), ("agent-unique", uniq_a),
                        ("probity-twice", twice)]:
        (out / f"{name}.ndjson").write_text("\n".join(lines) + "\n")

    # cedar-agent's store: the cluster, with `blocked` as an attribute, and the
    # configuration entities probity serves.
    blocked = set(sys.argv[3].split(",")) if len(sys.argv) > 3 and sys.argv[3] else set()
    data = []
    for e in cluster:
        e = json.loads(json.dumps(e))
        if e["uid"]["type"] == "Node":
            e["attrs"]["blocked"] = e["uid"]["id"] in blocked
        data.append(e)
    config = out / "config-entities.jsonl"
    if config.exists():
        data += [json.loads(line) for line in config.read_text().splitlines() if line.strip()]
    (out / "agent-data.json").write_text(json.dumps(data))


if __name__ == "__main__":
    main()
