"""The HTTP side: the gateway's routes and their composition (``server``), body parsing,
the front door every request enters by, uploads and remote inputs, predictions, the OpenAI
route, outputs, metrics, limits, the web page, and the Python client of it all. Imports the
rooms below it (``jobs``, ``fleet``, ``control``, ``state``); never torch."""
