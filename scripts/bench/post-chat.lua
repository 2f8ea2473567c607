-- wrk script: POST a small chat completion.
wrk.method = "POST"
wrk.headers["content-type"] = "application/json"
wrk.body = '{"model":"sim-model","messages":[{"role":"user","content":"hi"}]}'
