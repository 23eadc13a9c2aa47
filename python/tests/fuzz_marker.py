"""What a hostile pickle runs, made harmless: the differential test of shardwise's archive reader
(torch_reader_diff.py) unpickles its payloads with torch.load(weights_only=False) and sees
whether torch imported and called this instead of, say, os.system."""

CALLS: list[tuple] = []


def touch(*args):
    CALLS.append(args)
    return args


def touch_file(path):
    """Creates ``path``: the trace a payload leaves when a load runs it in another process."""
    with open(path, "w") as f:
        f.write("ran")
    return path
