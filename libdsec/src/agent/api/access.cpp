// Who may call, and what they may touch: the caller's identity from its bearer token (or the operator's socket), and
// the tenant checks every route makes before it turns an id, a group or an image name into an object. Another
// tenant's sandbox, group or snapshot answers exactly as one that does not exist. docs/security.md lists which check
// guards each route.
#include "agent/api/router.hpp"

#include <fmt/format.h>

#include "agent/api/router_internal.hpp"

namespace dsec::agent {
namespace http = boost::beast::http;

auth::Principal Router::authenticate(const HttpRequest& request, const Peer& peer, Route route) {
  if (!access_.tokens) return auth::operator_principal();
  auto header = request.find(http::field::authorization);
  if (!peer.tcp && !access_.tokens_on_unix) {
    // The operator's socket: a caller that presents a token acts as that token's tenant (a gateway that serves its
    // tenants from one socket, docs/e2b.md); one that presents none is the operator.
    if (header == request.end()) return auth::operator_principal();
    std::optional<auth::Principal> who = access_.tokens->authenticate(std_view(header->value()));
    if (!who) {
      metrics_.unauthenticated();
      throw Error(Code::kUnauthenticated, "the bearer token is not one of this node's");
    }
    return *who;
  }
  // A load balancer's health check carries no token.
  if (route == Route::kHealthz) return auth::operator_principal();
  if (header == request.end()) {
    metrics_.unauthenticated();
    throw Error(Code::kUnauthenticated,
                "this node needs a bearer token: send 'Authorization: Bearer <token>' "
                "(ClientOptions::token, dsec.Client(token=...), $DSEC_TOKEN)");
  }
  std::optional<auth::Principal> who = access_.tokens->authenticate(std_view(header->value()));
  if (!who) {
    metrics_.unauthenticated();
    throw Error(Code::kUnauthenticated, "the bearer token is not one of this node's");
  }
  return *who;
}

// Snapshots a tenant takes are images named tenants/<tenant>/...: its own to start sandboxes from, nobody else's.
// Images outside tenants/ (the operator's) are everyone's.
std::string tenant_image_prefix(const auth::Principal& who) { return fmt::format("{}{}/", kTenantImages, who.tenant); }

bool tenant_may_use_image(const auth::Principal& who, std::string_view image) {
  if (who.admin || !image.starts_with(kTenantImages)) return true;
  return image.starts_with(tenant_image_prefix(who));
}

// A tenant's request ids are its own: the same id from two tenants names two requests, and one tenant's cannot
// tell whether another's exists.
std::string tenant_request_id(const auth::Principal& who, const std::string& request_id) {
  if (who.admin || request_id.empty()) return request_id;
  return fmt::format("{}:{}", who.tenant, request_id);
}

// One tenant cannot learn which group ids another uses, nor take one another will use: its ids name its own groups.
std::string tenant_group_id(const auth::Principal& who, const std::string& group) {
  if (who.admin || group.empty()) return group;
  if (!protocol::valid_group_id(group))
    throw Error(Code::kInvalidArgument,
                fmt::format("group: '{}' is not a group id (1 to {} letters, digits, '.', '_', '-')", group,
                            protocol::kMaxGroupIdBytes));
  return fmt::format("{}:{}", who.tenant, group);
}

std::string shown_group_id(const auth::Principal& who, const std::string& group) {
  if (who.admin) return group;
  const std::string own = who.tenant + ":";
  return group.starts_with(own) ? group.substr(own.size()) : group;
}

// Another tenant's snapshot answers in the same words whether it exists or not.
void Router::check_image_access(const auth::Principal& who, const std::string& image) {
  if (tenant_may_use_image(who, image)) return;
  throw Error(Code::kNotFound,
              fmt::format("image {} not found: tenant '{}' starts sandboxes from its own snapshots ({}...) and from "
                          "images outside {}",
                          image, who.tenant, tenant_image_prefix(who), kTenantImages));
}

void Router::check_sandbox_access(const auth::Principal& who, const std::string& id) {
  if (who.admin) return;
  // Another tenant's sandbox answers exactly as one that does not exist: no way to learn which ids are in use.
  if (!who.may_see(registry_.spec(id).tenant))
    throw Error(Code::kNotFound, fmt::format("sandbox '{}' not found on node '{}'", id, registry_.options().node_id));
}

void Router::check_group_access(const auth::Principal& who, const std::string& group) {
  if (who.admin) return;
  auto not_found = [&] {
    return Error(Code::kNotFound, fmt::format("group '{}' not found on node '{}' (it has no sandboxes here, was "
                                              "deleted, or its lease expired)",
                                              shown_group_id(who, group), registry_.options().node_id));
  };
  GroupInfo g = registry_.get_group(group);
  // A tenant's group is one whose sandboxes are all that tenant's.
  if (g.sandboxes.empty()) throw not_found();
  for (const auto& sb : g.sandboxes)
    if (!who.may_see(sb.tenant)) throw not_found();
}

}  // namespace dsec::agent
