"""Search the legal schedules of a file (space, bounds, search) and measure the finalists."""
