"""On-disk formats written and read by kvq."""
