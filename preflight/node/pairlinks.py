"""The pairwise phase's rules for a straggler and a slow link, in one place for both sides: the nodes use them to
find the links to re-measure alone after the rounds (preflight.node.allreduce), the head to judge the matrix
(preflight.collective.pairwise), so the two never disagree. Standard library only: it is shipped to the nodes.

`rates` is {(a, b): gbps} with a < b, node indices (or names) of the links measured."""
import statistics

SLOWER = 4.0  # "several times slower": a row, or a link, this many times below its peers' median
SLOW_LINK_NODES = 4  # a single slow link is judged from this many nodes on (each end then has two other links)


def _median(values):
    return statistics.median(values) if values else None


def stragglers(rates):
    """{node: (its best link, the median of the links between the others)} for every node whose links are all
    SLOWER times below the links between the other nodes."""
    out = {}
    for x in sorted({n for link in rates for n in link}):
        own = [v for (a, b), v in rates.items() if x in (a, b)]
        others = [v for (a, b), v in rates.items() if x not in (a, b)]
        if len(own) >= 2 and others and max(own) * SLOWER < _median(others):
            out[x] = (max(own), _median(others))
    return out


def slow_links(rates, count, slow_nodes=()):
    """[(a, b, gbps, expected)] in the order of (a, b): one link SLOWER times below the median of each end's other
    links (expected: the lower of the two medians), from SLOW_LINK_NODES of `count` nodes on; a link with an end in
    `slow_nodes` (the stragglers: their whole row is slow) is not one."""
    if count < SLOW_LINK_NODES:  # with three nodes each end has one other link: one busy moment would be enough
        return []
    out = []
    for (a, b), v in sorted(rates.items()):
        if a in slow_nodes or b in slow_nodes:
            continue
        ends = [_median([w for (c, d), w in rates.items() if x in (c, d) and (c, d) != (a, b)]) for x in (a, b)]
        if all(e is not None for e in ends) and v * SLOWER < min(ends):
            out.append((a, b, v, min(ends)))
    return out


def still_slow(rates, count, alone):
    """The slow links once the suspects were measured again alone: `rates` are the rounds' figures, `alone`
    {(a, b): gbps} the retests'. A suspect is judged from the rounds (the other links were measured as it was, with
    the other pairs' traffic); one measured again is slow only if its retest is still SLOWER times below its ends'
    other links (its figure is then the retest's), else it was only busy in its round."""
    out = []
    for a, b, v, expected in slow_links(rates, count, stragglers(rates)):
        again = alone.get((a, b))
        if again is None or again * SLOWER < expected:
            out.append((a, b, v if again is None else again, expected))
    return out
