"""results_csv.py: rows appended to a benchmark's CSV, for the benchmarks
beside this file: the header is written when the file is new or empty, so
that runs of one benchmark, each a process, add to one table."""
import csv
import os


def append_rows(path, columns, rows):
    """Append `rows` (dicts; a missing column is left empty) to the CSV at
    `path` with `columns`."""
    new = not os.path.exists(path) or os.path.getsize(path) == 0
    with open(path, "a", newline="") as f:
        w = csv.DictWriter(f, fieldnames=columns)
        if new:
            w.writeheader()
        w.writerows({k: row.get(k, "") for k in columns} for row in rows)
