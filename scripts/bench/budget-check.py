#!/usr/bin/env python3
"""The instruction budget's verdict (scripts/bench/proxy-profile --budget).

Usage: budget-check.py OUT BUDGET_FILE WRITE

OUT holds, per proxy NAME (flowgate, pingora) and request KIND, callgrind's
dump NAME-KIND.dump and the requests it answered NAME-KIND.requests.
Prints instructions per request of each kind (Flowgate, bare Pingora for
scale, their ratio, the budget) and exits 1 when Flowgate's count of a kind
exceeds its budget by more than TOLERANCE, printing the proxy hooks that
grew. WRITE=1 rewrites BUDGET_FILE with what was measured instead.
"""

import os
import re
import subprocess
import sys

TOLERANCE = 0.03
KINDS = ["small", "stream", "queued", "key"]
# Flowgate's proxy hooks (and the connection loop a parked request waits
# in), by the name callgrind gives their code.
HOOKS = {
    "new_ctx": "ProxyHttp>::new_ctx",
    "request_filter": "ProxyHttp>::request_filter",
    "upstream_peer": "ProxyHttp>::upstream_peer",
    "upstream_request_filter": "ProxyHttp>::upstream_request_filter",
    "upstream_response_filter": "ProxyHttp>::upstream_response_filter",
    "response_filter": "ProxyHttp>::response_filter",
    "response_body_filter": "ProxyHttp>::response_body_filter",
    "request_body_filter": "ProxyHttp>::request_body_filter",
    "logging": "ProxyHttp>::logging",
    "parked_wait": "parking::",
}


def profile(out, name, kind):
    """NAME's dump for KIND, read once: instructions per request, and each
    function's inclusive instructions per request (name, count); None if
    there is no dump."""
    dump = os.path.join(out, f"{name}-{kind}.dump")
    if not os.path.exists(dump):
        return None
    requests = int(open(os.path.join(out, f"{name}-{kind}.requests")).read())
    text = subprocess.run(
        ["callgrind_annotate", "--inclusive=yes", "--threshold=100", dump],
        capture_output=True, text=True, check=True,
    ).stdout
    total = int(re.search(r"([\d,]+) \(100.0%\)\s+PROGRAM TOTALS", text).group(1).replace(",", ""))
    functions = []
    for line in text.split("\n"):
        m = re.match(r"\s*([\d,]+) \([^)]*\)\s+\S*?:(.*)$", line)
        if m:
            name = re.sub(r"\s*\[.*$", "", m.group(2))
            functions.append((name, int(m.group(1).replace(",", "")) / requests))
    return total / requests, functions


def hooks(functions):
    """Inclusive instructions per request of each hook (the largest entry
    of its name: an async hook shows as its future's poll and callers)."""
    found = {}
    for fn, n in functions:
        for hook, pattern in HOOKS.items():
            if pattern in fn and "balancer::" in fn:
                found[hook] = max(found.get(hook, 0), n)
    return found


def ours(functions, top=10):
    """The costliest of Flowgate's own functions, inclusive, per request."""
    rows = [(n, fn) for fn, n in functions if re.search(r"\b(balancer|flowgate)::", fn)]
    return sorted(rows, reverse=True)[:top]


def read_budget(path):
    budget, hook_budget = {}, {}
    if not os.path.exists(path):
        return budget, hook_budget
    for line in open(path):
        line = line.split("#", 1)[0].split()
        if len(line) == 3 and line[0] in KINDS:
            budget[line[0]] = (int(line[1]), None if line[2] == "-" else int(line[2]))
        elif len(line) == 4 and line[0] == "hook":
            hook_budget[(line[1], line[2])] = int(line[3])
    return budget, hook_budget


def write_budget(path, rows, hook_rows):
    with open(path, "w") as f:
        f.write(
            "# Flowgate's instruction budget: instructions per request of each kind,\n"
            "# counted by `scripts/bench/proxy-profile --budget` (callgrind; the dev\n"
            "# profile's optimised dependencies, Flowgate's crates optimised as in\n"
            "# release). CI fails when Flowgate's count of a kind exceeds its budget\n"
            "# by more than 3 %. Lower a number in its own commit; raise one only\n"
            "# with a line in BENCHMARKS.md saying what the cost buys.\n"
            "# kind flowgate pingora (bare Pingora for scale; - : no such request there)\n"
        )
        for kind, (fg, pg) in rows.items():
            f.write(f"{kind} {fg} {pg if pg is not None else '-'}\n")
        f.write("# The proxy hooks when the budget was written, inclusive, per request:\n"
                "# not checked, only compared to say what grew.\n")
        for (kind, hook), n in hook_rows.items():
            f.write(f"hook {kind} {hook} {n}\n")


def main():
    out, path, write = sys.argv[1], sys.argv[2], sys.argv[3] == "1"
    budget, hook_budget = read_budget(path)
    rows, hook_rows, over = {}, {}, []
    print(f"{'kind':<8} {'Flowgate':>10} {'Pingora':>10} {'ratio':>6} {'budget':>10} {'vs budget':>9}")
    for kind in KINDS:
        measured = profile(out, "flowgate", kind)
        if measured is None:
            print(f"budget: no measurement of {kind}", file=sys.stderr)
            sys.exit(1)
        fg, functions = measured
        pg = (profile(out, "pingora", kind) or (None, None))[0]
        rows[kind] = (round(fg), None if pg is None else round(pg))
        for hook, n in hooks(functions).items():
            hook_rows[(kind, hook)] = round(n)
        b = budget.get(kind, (None, None))[0]
        vs = f"{fg / b - 1:+.1%}" if b else "new"
        ratio = f"x{fg / pg:.2f}" if pg else "-"
        print(f"{kind:<8} {fg:>10,.0f} {pg or 0:>10,.0f} {ratio:>6} {b or 0:>10,} {vs:>9}")
        if b and fg > b * (1 + TOLERANCE):
            over.append((kind, functions))
        bp = budget.get(kind, (None, None))[1]
        if pg and bp and abs(pg / bp - 1) > TOLERANCE:
            print(f"  (bare Pingora's {kind} moved {pg / bp - 1:+.1%} from the budget's: "
                  "a toolchain or dependency change, not Flowgate's own)")
    if write:
        write_budget(path, rows, hook_rows)
        print(f"budget: wrote {path}")
        return
    if not budget:
        print(f"budget: {path} is missing; write it with --budget --write", file=sys.stderr)
        sys.exit(1)
    for kind, functions in over:
        print(f"\n{kind}: over budget by more than {TOLERANCE:.0%}. Hooks, inclusive, per request "
              "(now / at the budget):")
        for hook in HOOKS:
            now, then = hook_rows.get((kind, hook)), hook_budget.get((kind, hook))
            if now is None and then is None:
                continue
            grew = (now or 0) - (then or 0)
            mark = "  <- grew" if grew > max(200, 0.005 * budget[kind][0]) else ""
            print(f"  {hook:<26} {now or 0:>9,} / {then or 0:>9,}  {grew:+,}{mark}")
        print("  Flowgate's costliest functions now, inclusive, per request:")
        for n, fn in ours(functions):
            print(f"    {n:>9,.0f}  {fn[:130]}")
    if over:
        print("\nbudget: over. Find what grew with `scripts/bench/proxy-profile`; if the cost buys "
              "something, raise the budget with a line in BENCHMARKS.md saying what.", file=sys.stderr)
        sys.exit(1)
    print("budget: within")


if __name__ == "__main__":
    main()
