"""Tools around a run: the launcher, benchmark, plain baseline, reports, plots and the dry run."""
