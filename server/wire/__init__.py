"""Between the front end and the engine core processes: the messages and their transport."""
