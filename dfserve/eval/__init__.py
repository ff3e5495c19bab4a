"""Offline drafter evaluation: drafters scored on cached target features of coding tasks, as online greedy decoding
would score them (`dfserve eval`)."""
