"""`redrafter-mlx serve`: an OpenAI-compatible HTTP server (app.py) over a scheduler that owns the model
(scheduler.py); the wire format in protocol.py, stop strings in stops.py, the chat page in page.html."""
