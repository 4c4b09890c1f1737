"""The command line's plumbing (`dpojax.main` is the command): its output and exits, argv
rewriting, and the one-line errors of the flag parser."""
