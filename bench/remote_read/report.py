"""The table and the target lines of bench_remote_read, from the children's results."""

from __future__ import annotations

import statistics

from .readers import FLOOR_CONNECTIONS

CHILD_TIMEOUT_S = 240


def read_ahead_bound_mb() -> float:
    """The read-ahead's memory bound per process (StreamConfig's defaults), as the target was set:
    its budget, plus a block per open stream (KEEP_OPEN shards x 2 tars), the block each was
    handing out having then left the budget. Blocks now hold the budget until they are handed
    out, so that allowance is what the fetch threads and the key-index planning may add.
    Derived, so a change of the defaults moves the target;
    imported here, not at the top: every child (the LitData one in its own virtualenv) imports
    this module, and the peers' peak RSS must not carry torch."""
    from loader.io import StreamConfig
    from loader.wds.twin_reader import KEEP_OPEN

    defaults = StreamConfig()
    return (defaults.read_ahead_bytes + KEEP_OPEN * 2 * defaults.read_ahead_block) / 1e6


def peak_rss(x: dict, workers: int) -> float:
    """Peak RSS of the process that reads: the training process, or its largest worker."""
    return x.get("child_rss_mb", 0.0) if workers else x.get("rss_mb", 0.0)


def report(results: dict, delays, rows, contenders, n: int, tar_bytes: int, checks: dict) -> None:
    med = statistics.median
    print()
    print("| delay | workers | decode | reader | samples/s | MB/s | CPU-s / 1000 samples | server + proxy CPU-s / 1000 "
          "samples | fetched MB / 1000 samples | peak RSS MB per reading process | ours / reader |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    verdicts, likes = [], []
    for delay in delays:
        fl = results[(delay, "floor")]
        floor_rate = med(n / x["wall"] for x in fl)
        for w, d in rows:
            ours = results[(delay, w, d, "ours")]
            for name in contenders:
                runs = results[(delay, w, d, name)]
                if any(x.get("timed_out") for x in runs):  # no rate to compare: said, not guessed
                    print(f"| {delay} ms | {w} | {d} | {name} | timed out | | | | | | |")
                    if name not in ("ours", "ours, no read-ahead"):
                        verdicts.append((False, f"ours >= 1.0x {name} samples/s at {delay} ms, {w} workers, "
                                         f"decode {d}", f"{name} timed out after {CHILD_TIMEOUT_S} s"))
                    continue
                rate = med(x["samples"] / x["wall"] for x in runs)
                mbs = med(tar_bytes / 1e6 / x["wall"] for x in runs)
                cpu = med(x["cpu"] / max(1, x["samples"]) * 1000 for x in runs)
                storage = med(x.get("storage_cpu", 0.0) / max(1, x["samples"]) * 1000 for x in runs)
                fetched = med(x["forwarded"] / max(1, x["samples"]) * 1000 / 1e6 for x in runs)
                ratio = med(o["samples"] / o["wall"] / max(1e-9, x["samples"] / x["wall"]) for o, x in zip(ours, runs, strict=True))
                rss = max(peak_rss(x, w) for x in runs)
                print(f"| {delay} ms | {w} | {d} | {name} | {rate:.0f} | {mbs:.0f} | {cpu:.2f} | {storage:.2f} | {fetched:.1f} | {rss:.0f} | "
                      f"{'' if name == 'ours' else f'{ratio:.2f}x'} |")
                if name not in ("ours", "ours, no read-ahead"):
                    verdicts.append((ratio >= 1.0, f"ours >= 1.0x {name} samples/s at {delay} ms, {w} workers, decode {d}",
                                     f"{ratio:.2f}x"))
            if d == "none":
                ratio = med(n / o["wall"] for o in ours) / floor_rate
                verdicts.append((ratio >= 0.8, f"ours >= 0.8x the x{FLOOR_CONNECTIONS} parallel-GET floor at {delay} ms, "
                                 f"{w} workers, decode none", f"{ratio:.2f}x: {med(n / o['wall'] for o in ours):.0f} vs "
                                 f"{floor_rate:.0f} samples/s"))
                fw = results.get((delay, "floor", w))
                if fw:  # the same GETs over w workers, handed through the DataLoader as ours are
                    # Ratios within a round: the floor over w workers runs in the round ours does.
                    ratio = med(o["samples"] / o["wall"] / (n / x["wall"]) for o, x in zip(ours, fw, strict=True))
                    verdicts.append((ratio >= 0.8, f"ours >= 0.8x the x{FLOOR_CONNECTIONS} parallel-GET floor handed "
                                     f"through {w} DataLoader workers at {delay} ms, decode none",
                                     f"{ratio:.2f}x: {med(n / o['wall'] for o in ours):.0f} vs "
                                     f"{med(n / x['wall'] for x in fw):.0f} samples/s"))
        floors = [("-", f"floor (x{FLOOR_CONNECTIONS} ranged GETs)", fl)]
        floors += [(w, f"floor (x{FLOOR_CONNECTIONS} ranged GETs over {w} DataLoader workers)", results[(delay, "floor", w)])
                   for w in sorted({w for w, _ in rows}) if (delay, "floor", w) in results]
        # Like for like: ours learns what to read (its manifests) on the clock; these floors do too.
        fd0 = results.get((delay, "floor+d"))
        if fd0:
            floors.append(("-", f"floor with discovery (the manifests' GETs, then x{FLOOR_CONNECTIONS} ranged GETs)", fd0))
        for w in sorted({w for w, d in rows if d == "none"}):
            ours, fdw = results[(delay, w, "none", "ours")], results.get((delay, "floor+d", w))
            if fdw:
                floors.append((w, f"floor with discovery over {w} DataLoader workers", fdw))
            for over, fd in ((None, fd0), (w, fdw if w else None)):
                if fd:
                    ratio = med(o["samples"] / o["wall"] / (n / x["wall"]) for o, x in zip(ours, fd, strict=True))
                    likes.append(f"ours {ratio:.2f}x the floor with discovery{f' over {over} DataLoader workers' if over else ''}"
                                 f" at {delay} ms, {w} workers, decode none")
        for w, name, runs in floors:
            print(f"| {delay} ms | {w} | - | {name} | {med(n / x['wall'] for x in runs):.0f} | "
                  f"{med(tar_bytes / 1e6 / x['wall'] for x in runs):.0f} | {med(x['cpu'] / n * 1000 for x in runs):.2f} | "
                  f"{med(x.get('storage_cpu', 0.0) / n * 1000 for x in runs):.2f} | "
                  f"{med(x['forwarded'] / n * 1000 / 1e6 for x in runs):.1f} | {max(peak_rss(x, 0 if w == '-' else w) for x in runs):.0f} | |")
    seq = [x for (delay, *rest), runs in results.items() if rest[-1:] == ["ours"] and rest[0] == 0 for x in runs]
    if seq:
        factor = max(x["fetched"] / x["handed"] for x in seq) if all(x["handed"] for x in seq) else float("inf")
        verdicts.append((factor <= 1.05, "ours' bytes fetched <= 1.05x bytes handed out, sequential plan (0 workers)",
                         f"{factor:.3f}x at most"))
    base = {k[:3]: v for k, v in results.items() if len(k) == 4 and k[3] == "ours, no read-ahead"}
    if base:
        grown = max(max(peak_rss(x, k[1]) for x in results[(*k, "ours")]) - max(peak_rss(x, k[1]) for x in runs)
                    for k, runs in base.items())
        bound = read_ahead_bound_mb()
        verdicts.append((grown <= bound, f"ours' peak RSS per reading process <= the same without "
                         f"read-ahead + the read-ahead's bound ({bound:.0f} MB)",
                         f"+{grown:.0f} MB at most"))
    verdicts.append((all(v == "equal" for v in checks.values()), "every reader's samples equal the source's",
                     ", ".join(f"{k}: {v}" for k, v in checks.items())))
    print()
    for line in likes:  # no targets: what the floor targets above leave out, reported beside them
        print(f"(like for like: {line})")
    for ok, target, measured in verdicts:
        print(f"{'PASS' if ok else 'MISS'}: {target} ({measured})")
