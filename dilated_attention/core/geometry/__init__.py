"""Which rows each kernel call reads: schedules, branch rows, documents, plans and slots."""
