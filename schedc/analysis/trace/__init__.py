"""The trace file of `schedc run --trace`: its schema (docs/trace.md), in one place, both ways.

Written (trace/write.py):
    chrome_events(rank, streams, spans, steps) -> [event]   one rank's events (the executor's)
    trace_file(events, schedule)               -> dict      the file's JSON, every rank's events
    chrome_trace(timeline)                     -> dict      a Timeline written the same way
Read (trace/stream.py, trace/read.py; the checks of each field in trace/schema.py):
    load(path)                             -> Trace      the file, checked, its op spans kept
    validate(data, path)                   -> Trace      the same, from parsed JSON
Against the schedule (trace/compare.py):
    measured(compiled, trace, step, ranks) -> Timeline   one step's spans, per rank and stream

A trace holds Chrome "X" events named by IR text (`bwd[h.3]@mb1`) with pid = rank and
args.step / args.stream, "M" events naming each rank's process and threads (one thread per
stream, a `steps` track, a `probe` thread), and otherData.schedule. The event constructors
of trace/write.py are the only place an event's shape is spelled out; the executor, the
probe (exec/probe.py) and `chrome_trace` write through them. Nothing here imports torch.
"""
