// E2B's control plane (the REST API at E2B_API_URL) on a dsec Client: what each call is in dsec.
//
//   POST   /v2/sandboxes               create: template = image, timeout = TTL, metadata = labels, envVars = env
//   GET    /v2/sandboxes               list, filtered by metadata and state, paged (X-Next-Token)
//   GET    /sandboxes/{id}             info
//   DELETE /sandboxes/{id}             destroy
//   POST   /sandboxes/{id}/timeout     the TTL from now
//   POST   /sandboxes/{id}/pause       sleep
//   POST   /v2/sandboxes/{id}/connect  wake if asleep; the TTL only ever extended
//   GET    /sandboxes/{id}/metrics     no samples (dsec keeps no time series)
//
// Errors are E2B's {"code": <HTTP status>, "message": ...}, with the statuses the SDKs turn into their exceptions
// (404 not found, 401, 429, 409 for a pause of a paused sandbox...).
#pragma once

#include <string>

#include "dsec/client.hpp"
#include "gateway/e2b/gateway.hpp"
#include "http/http.hpp"

namespace dsec::e2b {

agent::HttpResponse control_plane(Client& client, const GatewayOptions& options, agent::HttpRequest& request);

// E2B's REST error answer.
agent::HttpResponse rest_error(unsigned status, const std::string& message);
// dsec's error as E2B's REST error of the same meaning.
agent::HttpResponse rest_error(const Error& error);

}  // namespace dsec::e2b
