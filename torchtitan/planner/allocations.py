"""What PyTorch's CPU allocator held, read from a profile's allocation events: the measurements the
planner's estimates are checked against (scripts/validate_memory_estimate.py, tests/models/
test_activation_counts.py). Events are matched by address: a free recorded on another thread can
come after that address's next allocation, which a running sum of sizes would count twice; a free of
memory allocated before the profile is left out."""

from torch._C._profiler import _ExtraFields_Allocation
from torch.profiler import ProfilerActivity, profile


def memory_profile() -> profile:
    """A profiler that records every allocation and free (enter it, run, exit it)."""
    return profile(activities=[ProfilerActivity.CPU], profile_memory=True)


def held_over_time(prof: profile, device: str = "cpu") -> list[int]:
    """Bytes held by what was allocated during the profile, after each of its allocation events in
    time order."""
    results = prof.profiler.kineto_results if prof.profiler is not None else None
    assert results is not None, "the profile has not run"  # set when it exits
    events, stack = [], list(results.experimental_event_tree())
    while stack:
        e = stack.pop()
        stack.extend(e.children)
        fields = e.extra_fields  # an allocation event's (and a free's: a negative size)
        if isinstance(fields, _ExtraFields_Allocation) and fields.device.type == device:
            events.append((e.start_time_ns, fields.ptr, fields.alloc_size))
    live: dict[int, int] = {}
    held, out = 0, []
    for _, ptr, size in sorted(events):
        held -= live.pop(ptr, 0)
        if size > 0:
            live[ptr] = size
            held += size
        out.append(held)
    return out


def peak_bytes(prof: profile) -> int:
    """The most bytes held at once by what was allocated during the profile (what
    torch.cuda.max_memory_allocated counts on GPU, above the memory held when it began)."""
    return max(held_over_time(prof), default=0)


def kept_by(fn) -> tuple[int, object]:
    """(bytes `fn` allocated and left held, its result): run under a memory profile."""
    with memory_profile() as prof:
        out = fn()
    held = held_over_time(prof)
    return (held[-1] if held else 0), out
