#!/usr/bin/env python3
"""Summarise the power and clock samples that power_sampling_start (scripts/gpu-machine/env.sh)
writes: one line per labelled section, over its busy samples (the GPU drawing over 250 W): the
SM clock's median, min and max, the instantaneous power's median and max, and in how many
samples the driver flagged the software power cap (clocks_event_reasons bit 0x4)."""
import statistics
import sys

BUSY_W = 250.0

sections, label = {}, None
for line in open(sys.argv[1]):
    if line.startswith("== "):
        label = line[3:].strip()
        sections[label] = []
        continue
    cols = [c.strip() for c in line.split(",")]
    try:  # timestamp, clock "1980 MHz", power "700.00 W", ..., reasons "0x..."
        sections[label].append((float(cols[1].split()[0]), float(cols[2].split()[0]),
                                int(cols[-1], 16)))
    except (ValueError, IndexError, KeyError):
        continue
for label, rows in sections.items():
    busy = [r for r in rows if r[1] > BUSY_W]
    if not busy:
        print(f"{label}: {len(rows)} samples, none busy")
        continue
    clock, watts = [r[0] for r in busy], [r[1] for r in busy]
    capped = sum(1 for r in busy if r[2] & 4)
    print(f"{label}: {len(rows)} samples, {len(busy)} busy; SM MHz median "
          f"{statistics.median(clock):.0f} min {min(clock):.0f} max {max(clock):.0f}; W median "
          f"{statistics.median(watts):.0f} max {max(watts):.0f}; sw power cap in {capped}")
