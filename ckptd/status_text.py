"""`ckptd status`'s text for a person, from the daemon's status reply (JSON, FORMAT.md)."""
from __future__ import annotations

from typing import Any

from ckptd.daemon.shm import HUGE_MODES


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


def shared_memory(st: dict[str, Any]) -> str | None:
    """Where the daemon makes its shared memory and in which pages, from its status reply (memfds, or
    ``memory.shm_dir``'s tmpfs); None for a reply without it (an older daemon)."""
    mode = st.get("shmem_huge_pages")
    if mode is None:
        return None
    where = f"tmpfs {st['shm_dir']} huge={mode}" if st.get("shm_dir") else \
        f"memfds, transparent_hugepage/shmem_enabled {mode}"
    huge = mode in HUGE_MODES
    return f"{'huge where the kernel can' if huge else '4 KiB'} ({where}" \
        + ("" if huge else "; huge pages make restores from memory faster: docs/operations.md") + ")"


def memory_lines(mem: dict[str, Any] | None) -> list[str]:
    """``ckptd status``'s memory section, from the status reply's ``memory`` object."""
    if not mem or not mem.get("steps_per_job"):
        return ["memory tier: off"]
    t = mem["totals"]
    out = [f"memory tier: {_mib(mem['used_bytes'])} of {_mib(mem['budget_bytes'])} held, newest "
           f"{mem['steps_per_job']} committed step(s) per job; held={t['held']} evicted={t['evicted']} "
           f"not-held={t['skipped']} served={t['served']} corrupt={t['corrupt']}"]
    level = mem.get("memory_level")
    if level and (level["saves_started"] or level["last_committed"]):     # (save(level="memory"), counted apart)
        newest = ", ".join(f"{j}@{c['step']}" for j, c in level["last_committed"].items())
        out.append(f"memory-level saves: held={level['saves_held']} failed={level['saves_failed']} "
                   f"({_mib(level['bytes_held'])} held, never written), steps committed={level['steps_committed']} "
                   f"failed={level['steps_failed']}" + (f"; newest {newest}" if newest else ""))
    if mem.get("peer_address") or mem.get("replicas_k"):
        parity = mem.get("redundancy") == "parity"      # (then the sends are parity pieces, not shard copies)
        kind = f"parity, {_mib(mem.get('parity_held_bytes', 0))} of parity held" if parity \
            else f"K={mem['replicas_k']}"
        what = "piece" if parity else "replication"
        degraded = f", {mem['degraded_steps']} held step(s) degraded" if mem.get("degraded_steps") else ""
        out.append(f"peers: listening on {mem.get('peer_address') or '-'}, {kind}, "
                   f"refused={mem['peers_refused']} {what} failures={mem['replication_failures']} "
                   f"sent {_mib(mem['replicated_bytes'])}{' of pieces' if parity else ''}{degraded}")
        for peer, c in sorted(mem.get("peers", {}).items()):
            out.append(f"  peer {peer}: sent {_mib(c['sent_bytes'])}, {c['failures']} failed "
                       f"{'pieces' if parity else 'copies'}")
    for s in mem["held"]:
        ranks = ", ".join(f"{r}:{v['origin']}" + (" (in its slot)" if v.get("in_slot") else "")
                          + (f" {v['copies']} copies" if v["copies"] is not None else "")
                          + (" pinned" if v["pinned"] else "") for r, v in sorted(s["ranks"].items()))
        level = "replicated, " if s["replicated"] else ""
        if "protected" in s:        # redundancy = "parity": this node's pieces are in their parity
            level += "protected, " if s["protected"] else "degraded (parity incomplete), "
        kind = "memory-level step" if s.get("level") == "memory" else "step"
        out.append(f"  job={s['job']} {kind}={s['step']} {level}{'committed' if s['committed'] else 'not committed'}"
                   f" {_mib(s['bytes'])} ranks {ranks}")
    return out


def group_lines(groups: list[dict[str, Any]] | None, members: list[dict[str, Any]] | None = None) -> list[str]:
    """``ckptd status --group``: each held step of this node's parity group, protected or degraded, why;
    first, any member that did not answer (even with no step held)."""
    if groups is None:
        return ["parity group: this daemon is not in parity mode"]
    out = [f"parity group: member {m['member']} ({m['address']}) unreachable: {m['why']}"
           for m in members or () if not m.get("reachable", True)]
    if not groups:
        return [*out, "parity group: no held steps"]
    for g in groups:
        out.append(f"group {g['group']} ({g['members']} nodes): job={g['job']} step={g['step']} {g['state']}, "
                   f"{g['ranks']} ranks held")
        out += [f"  {why}" for why in g["why"]]
    return out
