"""`Examples:` for every command's help, in one table so a test can hold every command to having them.

Keyed by the command's path below `bsr` ("settings set"). Each line is a full command line as an operator types it.
"""

from __future__ import annotations

EXAMPLES: dict[str, tuple[str, ...]] = {
    "rws": (
        "bsr rws -r paper-mtp-off --W 32 --tokens 262144",
        "bsr rws --hf-config examples/config.json --world-size 2 --dtype fp8 --sweep 16,32,64",
    ),
    "plan": (
        "bsr plan --W 32",
        "bsr plan --W 32 --tokens 524032 -r paper-mtp-on",
        "bsr plan --W 16 --tokens 131072 --hf-config examples/config.json --world-size 2 --block-size 64",
        "bsr probe --synthetic 65536 --seed 1 --json > probe.json && bsr plan --W 16 --probe probe.json",
        "bsr plan --trace examples/trace.jsonl -r paper-mtp-off --W 32 --bandwidth 10.31GB/s --p99 1",
    ),
    "probe": (
        "bsr probe --synthetic 65536 --seed 1",
        "bsr probe --tokens-file prompt.json --engine vllm-r1 --json",
        "bsr probe --store mooncake://10.0.0.5:50051 --model my-org/my-model --world-size 2 --tokens-file prompt.json",
    ),
    "submit": (
        "bsr submit --synthetic 65536 --seed 1",
        "bsr submit --prompt-file incident-prompt.txt --W 16",
    ),
    "restore": (
        "bsr restore --synthetic 65536 --seed 1 --W 32",
        "bsr restore --tokens-file prompt.json --dry-run --W 64",
        "bsr restore --synthetic 65536 --seed 1 --exclude-tier mooncake",
        "bsr restore --synthetic 65536 --seed 1 --tier fs",
    ),
    "inject-fault": (
        "bsr inject-fault --rank 1 --kind restore-fault --window 3",
        "bsr inject-fault --kind remote-unavailable --count 0",
    ),
    "status": (
        "bsr status",
        "bsr status --engine prod-node2 --json",
        "bsr status --engine http://10.0.0.5:8470,http://10.0.0.6:8470 --engine prod-node2",
        "bsr status --engines-from prometheus://prom.lab:9090?job=bsr",
    ),
    "explain": (
        "bsr explain --synthetic 65536 --seed 1",
        "bsr explain req-00012",
        "bsr explain --tokens-file prompt.json --W 64 --json",
        "bsr explain --store mooncake://10.0.0.5:50051 --model my-org/my-model --world-size 2 --tokens-file p.json",
    ),
    "scrub": (
        "bsr scrub --tier fs --synthetic 65536 --seed 1",
        "bsr scrub --tier fs --tokens-file prompt.json --json",
        "bsr scrub --tier fs --all --max-bytes 64GiB",
    ),
    "bundle": (
        "bsr bundle -o incident.tar.gz",
        "bsr bundle --synthetic 65536 --seed 1 --max-bytes 4MiB -o ticket-1234.tar.gz",
    ),
    "drill": ("bsr drill --yes", "bsr drill --tokens 16384 --W 8 --yes"),
    "abort": ("bsr abort req-00012",),  # exit 18 once it has ended: the abort came too late
    "events": ("bsr events -n 20", "bsr events -f --request req-00012", "bsr events --since 20m --json"),
    "describe": ("bsr describe req-00012", "bsr describe req-00012 --record incident.tar.gz"),
    "top": (
        "bsr top",
        "bsr top --record incident.bsrtop.gz",
        "bsr top --replay incident.bsrtop.gz",
        "bsr top --engine vllm-r0,vllm-r1,prod-node2",
        "bsr top --engines-from dns://bsr-engines.lab:8470 --record fleet.gz",
    ),
    "config show": ("bsr config show", "bsr --engine prod config show --json"),
    "registration show": ("bsr registration show paper-mtp-off", "bsr registration show my-model.yaml --all-tensors"),
    "registration diff": ("bsr registration diff paper-mtp-off paper-mtp-on",),
    "engine up": ("bsr engine up --enable-faults", "bsr engine up --W 16 --budget 32MiB --max-tokens 131072"),
    "engine down": ("bsr engine down",),
    "engine status": ("bsr engine status", "bsr engine status --json"),
    "engine endpoints": ("bsr engine endpoints", "bsr --engine http://127.0.0.1:9100 engine endpoints --json"),
    "faults inject": ("bsr faults inject --rank 1 --kind timeout --window 2",),
    "faults list": ("bsr faults list",),
    "faults clear": ("bsr faults clear",),
    "markers list": ("bsr markers list", "bsr markers list --json"),
    "markers clear": (
        "bsr markers clear --prompt 3f2a9c1e0b7d4a65",
        "bsr markers clear --tier mooncake",
        "bsr markers clear --all --yes",
    ),
    "settings show": ("bsr settings show", "bsr settings show --engine prod --json"),
    "settings set": ("bsr settings set --W 16", "bsr settings set --budget 64MiB --fs-concurrency 4"),
    "pool": ("bsr pool --once", "bsr pool --json"),
    "pool reset-peak": ("bsr pool reset-peak",),
    "monitoring rules": (
        "bsr monitoring rules --runbook-base https://wiki.example.com/bsr/runbooks -o /etc/prometheus/bsr-alerts.yml",
        "bsr monitoring rules --runbook-base https://git.example.com/bsr/blob/main/docs/runbooks > bsr-alerts.yml",
    ),
    "bench sweep": ("bsr bench sweep --embedded", "bsr bench sweep --tokens 32768,131072 --W 32"),
    "bench ladder": ("bsr bench ladder",),
    "bench wlaw": ("bsr bench wlaw --embedded --Ws 8,16,32",),
    "bench fs-concurrency": ("bsr bench fs-concurrency --embedded",),
    "bench store": ("bsr bench store --embedded --trials 7",),
    "bench failures": ("bsr bench failures --embedded",),
    "bench peer": ("bsr bench peer --trials 3 --below-rung 256MiB,1GiB",),
    "bench cpu-bound": ("bsr bench cpu-bound --trials 3", "bsr bench cpu-bound --tokens 65536 --budgets 1,2,4"),
    "bench trace": (
        "bsr bench trace conversation_trace.jsonl --requests 500",
        "bsr bench trace conversation_trace.jsonl -n 200 --skip 3000 --speedup 2 --W 8 --budget-rws 4",
    ),
    "bench plot": ("bsr bench plot --output bench-out",),
    "bench validate": ("bsr bench validate bench-out/br-*.json",),
    "bench schema": ("bsr bench schema > bench-schema.json",),
    "bench show": ("bsr bench show docs/evidence/br-e1-a6c2f9d328e2.json",),
}


def examples_block(path: str) -> str | None:
    """The help epilog's examples for one command; `\\b` keeps the help formatter from rewrapping the lines."""
    lines = EXAMPLES.get(path)
    if not lines:
        return None
    return "\b\nExamples:\n" + "\n".join(f"  {line}" for line in lines)
