"""The open-file limit of a process that serves many rollouts at once.

Each rollout in flight holds descriptors in the process that runs it (its sandbox's pipes, its socket bridge
and the calls spliced through it: ~5 at rest, more mid-call) and in the proxy (each agent's connection and its
upstream one). Measured at 128 in flight: 668 in the pool's process, 452 in the proxy's; 512 in flight needs
~2,700. Most Linux sessions start with a soft limit of 1,024 under a hard one far above it, and at the soft
limit a rollout fails on "Too many open files". A process may raise its own soft limit up to the hard one
without privilege, as servers do at start.
"""

from __future__ import annotations

CEILING = 1 << 20  # when the hard limit is unlimited: more than any run here opens, less than a kernel refuses


def raise_open_files_limit() -> int:
    """Raise this process's soft limit on open files to its hard limit; returns the soft limit now in force."""
    try:
        import resource
    except ImportError:  # not a POSIX system
        return -1
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = CEILING if hard == resource.RLIM_INFINITY else hard
    if soft != resource.RLIM_INFINITY and soft < wanted:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))
            soft = wanted
        except (ValueError, OSError):
            pass  # a kernel below the ceiling (nr_open): the limit stays where it was
    return soft
