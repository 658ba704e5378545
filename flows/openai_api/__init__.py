"""OpenAI's fine-tuning API, served here (`agentrft api`), for the official `openai` SDK.

Owns: the routes (`app.py`), what each route does to the stores, Prefect and MLflow
(`service.py`), the uploaded files (`files.py`), the jobs and their records (`jobs.py`), a
job body turned into a pipeline config (`job_body.py`, also `agentrft run --openai-job`),
reading a job's Prefect flow runs and MLflow runs back (`runs.py`), OpenAI's error shape
(`errors.py`) and starting the server with the Prefect server and deployment it needs
(`server.py`).
"""
