// The page's only talk with the server: /v1/models and a streamed /v1/chat/completions (SSE read
// with fetch + ReadableStream, so a Stop aborts the request and the server frees its slot).

export class HttpError extends Error {
  constructor(status, message, retryAfter) {
    super(message);
    this.status = status;
    this.retryAfter = retryAfter;
  }
}

function headers(apiKey) {
  const h = { "Content-Type": "application/json" };
  if (apiKey) h.Authorization = `Bearer ${apiKey}`;
  return h;
}

async function failure(response) {
  let message = response.statusText || "error";
  try {
    const body = await response.json();
    if (body && body.error && body.error.message) message = body.error.message;
  } catch (err) {
    // not our JSON error body (a proxy's page): the status line says enough
  }
  return new HttpError(response.status, message, response.headers.get("Retry-After"));
}

export async function listModels(apiKey) {
  const response = await fetch("/v1/models", { headers: headers(apiKey) });
  if (!response.ok) throw await failure(response);
  return (await response.json()).data.map((m) => m.id);
}

// Streams one reply; onDelta(text) per content piece, onThinking(text) per piece of a reasoning model's
// thinking, onUsage(usage) once at the end.
export async function streamChat(body, { apiKey, signal, onDelta, onThinking, onUsage }) {
  const response = await fetch("/v1/chat/completions", {
    method: "POST",
    headers: headers(apiKey),
    body: JSON.stringify({ ...body, stream: true, stream_options: { include_usage: true } }),
    signal,
  });
  if (!response.ok) throw await failure(response);
  const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  let finish = null;
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    buffer += value;
    let cut;
    while ((cut = buffer.indexOf("\n\n")) >= 0) {
      const event = buffer.slice(0, cut);
      buffer = buffer.slice(cut + 2);
      for (const line of event.split("\n")) {
        if (!line.startsWith("data:")) continue;
        const data = line.slice(5).trim();
        if (data === "[DONE]") return finish;
        const chunk = JSON.parse(data);
        if (chunk.error) throw new HttpError(chunk.error.code || 500, chunk.error.message || "stream failed");
        if (chunk.usage) onUsage(chunk.usage);
        for (const choice of chunk.choices || []) {
          if (choice.delta && choice.delta.reasoning_content) onThinking(choice.delta.reasoning_content);
          if (choice.delta && choice.delta.content) onDelta(choice.delta.content);
          if (choice.finish_reason) finish = choice.finish_reason;
        }
      }
    }
  }
  return finish;
}
