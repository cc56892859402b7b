"""Reads a SLURM job step's layout from its environment, in pure Python.

`ClusterConfig.from_slurm` used TensorFlow's `SlurmClusterResolver`, which
reads `os.environ` only. Reading a caller's mapping then meant writing it into
the process environment for the call, and `setenv` in a process whose
TensorFlow threads call `getenv` can crash it (CI saw a segmentation fault in
a TensorFlow thread right after such a call). The resolver also sorts host
names as text, so with `node[1-10]` rank 1 (on node2) was given node10's
address. This module reads the mapping it is given, writes nothing, and
keeps the node order SLURM gives, which is the order `srun` places ranks in.
"""

import re

# A host-list part: a prefix, then optionally one bracketed range list.
_PART = re.compile(r"([^,\[\]]*)(?:\[([^\[\]]+)\])?([^,\[\]]*)$")
_RANGE = re.compile(r"(\d+)(?:-(\d+))?$")
_REPEAT = re.compile(r"(\d+)(?:\(x(\d+)\))?$")


def expand_hostlist(text, name="SLURM_STEP_NODELIST"):
    """`'n[1-2,05],m'` -> `['n1', 'n2', 'n05', 'm']`, in SLURM's order.

    Zero padding follows the width of each range's first number, as in
    SLURM (`n[08-10]` -> `n08, n09, n10`).
    """
    hosts = []
    for part in _split_outside_brackets(text, name):
        match = _PART.match(part)
        if match is None or not (match.group(1) or match.group(2)):
            raise ValueError(
                f"{name}={text!r} is not a SLURM host list: cannot read "
                f"{part!r}. Expected names like 'node[1-4,7],login1'.")
        prefix, ranges, suffix = match.groups()
        if ranges is None:
            hosts.append(prefix + suffix)
            continue
        for item in ranges.split(","):
            numbers = _match(_RANGE, item, name, text,
                             f"has a bad range {item!r} in {part!r}. Expected numbers or "
                             "ranges like '[1-4,7]'.")
            first, last = numbers.group(1), numbers.group(2) or numbers.group(1)
            if int(last) < int(first):
                raise ValueError(
                    f"{name}={text!r} has a descending range {item!r}.")
            width = len(first)
            hosts.extend(f"{prefix}{i:0{width}d}{suffix}"
                         for i in range(int(first), int(last) + 1))
    if len(set(hosts)) != len(hosts):
        raise ValueError(f"{name}={text!r} names a node twice: {hosts}.")
    return hosts


def _split_outside_brackets(text, name):
    parts, current, depth = [], "", 0
    for char in text.strip():
        if char == "[":
            depth += 1
        elif char == "]":
            depth -= 1
        if depth not in (0, 1):
            raise ValueError(f"{name}={text!r} has unbalanced brackets.")
        if char == "," and depth == 0:
            parts.append(current)
            current = ""
        else:
            current += char
    if depth:
        raise ValueError(f"{name}={text!r} has unbalanced brackets.")
    parts.append(current)
    if any(not part for part in parts):
        raise ValueError(f"{name}={text!r} has an empty host name.")
    return parts


def _match(pattern, item, name, text, problem):
    """`pattern.match(item)` (stripped), or a `ValueError`: `name=text problem`."""
    match = pattern.match(item.strip())
    if match is None:
        raise ValueError(f"{name}={text!r} {problem}")
    return match


def expand_tasks_per_node(text, name="SLURM_STEP_TASKS_PER_NODE"):
    """`'2(x3),1'` -> `[2, 2, 2, 1]`."""
    counts = []
    for part in text.strip().split(","):
        match = _match(_REPEAT, part, name, text,
                       f"is not a SLURM tasks-per-node list: cannot read {part!r}. "
                       "Expected counts like '2(x3),1'.")
        counts.extend([int(match.group(1))] * int(match.group(2) or 1))
    return counts


def rank_addresses(nodelist, tasks_per_node, port_base):
    """`host:port` of every rank of a step with block distribution.

    Ranks fill the nodes in SLURM's order, each node taking its count of
    consecutive ranks; ports count up from `port_base` on each node.
    """
    hosts = expand_hostlist(nodelist)
    counts = expand_tasks_per_node(tasks_per_node)
    if len(hosts) != len(counts):
        raise ValueError(
            f"SLURM_STEP_NODELIST={nodelist!r} names {len(hosts)} node(s) but "
            f"SLURM_STEP_TASKS_PER_NODE={tasks_per_node!r} gives counts for "
            f"{len(counts)}. They must describe the same step.")
    return [f"{host}:{port_base + slot}"
            for host, count in zip(hosts, counts) for slot in range(count)]


def role_ranks(jobs):
    """`{role: range of ranks}`: roles in sorted order of their names, each
    taking the next `count` ranks (the order TensorFlow's resolver uses, kept
    so every existing SLURM script gives the same roles)."""
    ranges, start = {}, 0
    for role in sorted(jobs):
        ranges[role] = range(start, start + jobs[role])
        start += jobs[role]
    return ranges
