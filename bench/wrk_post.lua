-- wrk script: POST one chat-completion body over and over, each request under the next session key.
--   wrk -t1 -cN -dS --script post.lua URL -- KEYS_FILE BODY_FILE PATH
-- The requests are formatted once in init (a 200 KB body re-formatted per request would load wrk itself).
local requests = {}
local i = 0

function init(args)
  local f = assert(io.open(args[2], "rb"))
  local body = f:read("*a")
  f:close()
  for key in io.lines(args[1]) do
    requests[#requests + 1] = wrk.format("POST", args[3],
      {["Content-Type"] = "application/json", ["Authorization"] = "Bearer " .. key}, body)
  end
end

function request()
  i = i % #requests + 1
  return requests[i]
end

function done(summary, latency, requests)
  local e = summary.errors
  io.write(string.format("RESULT requests=%d duration_us=%d p50_us=%.1f p99_us=%.1f errors=%d\n",
    summary.requests, summary.duration, latency:percentile(50), latency:percentile(99),
    e.connect + e.read + e.write + e.status + e.timeout))
end
