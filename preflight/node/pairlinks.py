"""The pairwise phase's rules for a straggler and a slow link, in one place for both sides: the nodes use them to
find the links to re-measure alone after the rounds (preflight.node.allreduce), the head to judge the matrix
(preflight.collective.pairwise), so the two never disagree. Standard library only: it is shipped to the nodes.

`rates` is {(a, b): gbps} with a < b, node indices (or names) of the links measured."""
import statistics

SLOWER = 4.0  # "several times slower": a row, or a link, this many times below its peers' median
SLOW_LINK_NODES = 4  # a single slow link is judged from this many nodes on (each end then has two other links)


def _median(values):
    return statistics.median(values) if values else None


def _by_node(rates):
    """{node: [the gbps of each of its links]}."""
    out = {}
    for (a, b), v in rates.items():
        out.setdefault(a, []).append(v)
        out.setdefault(b, []).append(v)
    return out


def _median_without(values, value):
    """The median of `values` less one occurrence of `value` (None when nothing is left)."""
    rest = list(values)
    rest.remove(value)
    return _median(rest)


def stragglers(rates):
    """{node: (its best link, the median of the links between the others)} for every node whose links are all
    SLOWER times below the links between the other nodes."""
    out = {}
    everything = sorted(rates.values())
    for x, own in sorted(_by_node(rates).items()):
        others = list(everything)
        for v in own:  # the links between the other nodes: all of them but x's own
            others.remove(v)
        if len(own) >= 2 and others and max(own) * SLOWER < _median(others):
            out[x] = (max(own), _median(others))
    return out


def slow_links(rates, count, slow_nodes=()):
    """[(a, b, gbps, expected)] in the order of (a, b): one link SLOWER times below the median of each end's other
    links (expected: the lower of the two medians), from SLOW_LINK_NODES of `count` nodes on; a link with an end in
    `slow_nodes` (the stragglers: their whole row is slow) is not one."""
    if count < SLOW_LINK_NODES:  # with three nodes each end has one other link: one busy moment would be enough
        return []
    by_node = _by_node(rates)
    out = []
    for (a, b), v in sorted(rates.items()):
        if a in slow_nodes or b in slow_nodes:
            continue
        ends = [_median_without(by_node[x], v) for x in (a, b)]
        if all(e is not None for e in ends) and v * SLOWER < min(ends):
            out.append((a, b, v, min(ends)))
    return out


def judged(rates, count, alone):
    """(the slow links, the busy ones) once the suspects were measured again alone: `rates` are the rounds'
    figures, `alone` {(a, b): gbps} the retests'. A suspect is judged from the rounds (the other links were measured
    as it was, with the other pairs' traffic); one measured again is slow only if its retest is still SLOWER times
    below its ends' other links (its figure is then the retest's), else it was only busy in its round. The nodes
    measure the most suspect first (allreduce._suspects); when every one they measured again was fast alone, the
    suspects past their limit looked slow as those did, in the same busy rounds: busy, not slow. Each is a list
    of (a, b, gbps, expected)."""
    suspects = slow_links(rates, count, stragglers(rates))
    confirmed = any((a, b) in alone and alone[(a, b)] * SLOWER < expected for a, b, _, expected in suspects)
    cleared = not confirmed and any((a, b) in alone for a, b, _, _ in suspects)
    slow, busy = [], []
    for a, b, v, expected in suspects:
        again = alone.get((a, b))
        if again is not None:
            if again * SLOWER < expected:
                slow.append((a, b, again, expected))
        elif cleared:
            busy.append((a, b, v, expected))
        else:
            slow.append((a, b, v, expected))
    return slow, busy


def most_suspect_first(links):
    """slow_links' links, the slowest against its ends' other links first: the order the nodes measure them
    again in, so that a limit on the retests leaves out the least suspect."""
    return sorted(links, key=lambda link: (link[2] / link[3] if link[3] else 0.0, link[0], link[1]))
