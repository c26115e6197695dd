//! EndpointSlices decoded from a JSON list item's text with each endpoint's strings borrowed
//! from the text, for [`convert::endpoint_slice_noting`] through [`convert::SliceObject`].
//!
//! k8s-openapi's `EndpointSlice` owns a vector and a string for every endpoint's addresses and
//! a string for its node, which the conversion copies into the model and then frees with the
//! object; the endpoints are most of an input's objects (100k at 10k Services × 10 endpoints).
//! This decoding reads exactly what k8s-openapi's does, field by field, with the same types:
//! the slice's `metadata` and `ports` and an endpoint's `conditions`, `hints`, `targetRef` and
//! `deprecatedTopology` through k8s-openapi's own types, each of `addresses` as a string (the
//! first one kept), `nodeName`, `zone` and `hostname` as strings, anything else skipped. Where
//! it fails, the item is decoded through k8s-openapi as before, whose error the report names:
//! so it only ever has to agree on what k8s-openapi accepts. The tests and the fuzz target
//! `file_reader` compare it with reading through values.

use std::borrow::Cow;
use std::collections::BTreeMap;
use std::fmt;

use k8s_openapi::api::core::v1 as core;
use k8s_openapi::api::discovery::v1 as discovery;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use serde::de::{self, Deserialize, Deserializer, IgnoredAny, MapAccess, SeqAccess, Visitor};

use crate::model::convert::{EndpointObject, SliceObject};

/// An EndpointSlice as k8s-openapi reads it, with its endpoints' strings borrowed.
pub(super) struct Slice<'a> {
    metadata: ObjectMeta,
    address_type: Str<'a>,
    ports: Vec<discovery::EndpointPort>,
    endpoints: Vec<Endpoint<'a>>,
}

/// An endpoint of a [`Slice`].
pub(super) struct Endpoint<'a> {
    first_address: Option<Str<'a>>,
    conditions: Option<discovery::EndpointConditions>,
    hints: Option<discovery::EndpointHints>,
    node_name: Option<Str<'a>>,
    zone: Option<Str<'a>>,
}

/// Decodes an EndpointSlice list item's text; `None` where k8s-openapi's decoding must decide.
pub(super) fn decode(text: &str) -> Option<Slice<'_>> {
    serde_json::from_str(text).ok()
}

/// A JSON string, borrowed from the text unless it holds an escape.
struct Str<'a>(Cow<'a, str>);

impl<'de> Deserialize<'de> for Str<'de> {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct StrVisitor;
        impl<'de> Visitor<'de> for StrVisitor {
            type Value = Str<'de>;

            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a string")
            }

            fn visit_borrowed_str<E: de::Error>(self, v: &'de str) -> Result<Str<'de>, E> {
                Ok(Str(Cow::Borrowed(v)))
            }

            fn visit_str<E: de::Error>(self, v: &str) -> Result<Str<'de>, E> {
                Ok(Str(Cow::Owned(v.to_owned())))
            }

            fn visit_string<E: de::Error>(self, v: String) -> Result<Str<'de>, E> {
                Ok(Str(Cow::Owned(v)))
            }
        }
        deserializer.deserialize_string(StrVisitor)
    }
}

/// `addresses`: a list of strings, of which the first is kept; `null` reads as no address, as
/// k8s-openapi reads it (an empty list).
struct First<'a>(Option<Str<'a>>);

impl<'de> Deserialize<'de> for First<'de> {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct FirstVisitor;
        impl<'de> Visitor<'de> for FirstVisitor {
            type Value = First<'de>;

            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a sequence")
            }

            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<First<'de>, A::Error> {
                let first = seq.next_element::<Str<'de>>()?;
                // The others are never read, but k8s-openapi decodes each as a string.
                while seq.next_element::<Str<'de>>()?.is_some() {}
                Ok(First(first))
            }
        }
        deserializer.deserialize_seq(FirstVisitor)
    }
}

/// One field of a mapping: its value read as `T`, where k8s-openapi's reads an `Option<T>`
/// (`null` is absent).
fn field<'de, T: Deserialize<'de>, A: MapAccess<'de>>(map: &mut A) -> Result<Option<T>, A::Error> {
    map.next_value::<Option<T>>()
}

impl<'de> Deserialize<'de> for Slice<'de> {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct SliceVisitor;
        impl<'de> Visitor<'de> for SliceVisitor {
            type Value = Slice<'de>;

            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("an EndpointSlice")
            }

            // Only a mapping, as k8s-openapi (serde's derive would take an array as well).
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Slice<'de>, A::Error> {
                let mut slice = Slice {
                    metadata: ObjectMeta::default(),
                    address_type: Str(Cow::Borrowed("")),
                    ports: Vec::new(),
                    endpoints: Vec::new(),
                };
                while let Some(key) = map.next_key::<Str<'de>>()? {
                    match &*key.0 {
                        "apiVersion" => expect(&mut map, "discovery.k8s.io/v1")?,
                        "kind" => expect(&mut map, "EndpointSlice")?,
                        "metadata" => slice.metadata = field(&mut map)?.unwrap_or_default(),
                        "addressType" => {
                            slice.address_type = field(&mut map)?.unwrap_or(Str(Cow::Borrowed("")))
                        }
                        "ports" => slice.ports = field(&mut map)?.unwrap_or_default(),
                        "endpoints" => slice.endpoints = field(&mut map)?.unwrap_or_default(),
                        _ => {
                            map.next_value::<IgnoredAny>()?;
                        }
                    }
                }
                Ok(slice)
            }
        }
        deserializer.deserialize_map(SliceVisitor)
    }
}

/// `apiVersion` and `kind`: strings that k8s-openapi requires to be these.
fn expect<'de, A: MapAccess<'de>>(map: &mut A, expected: &'static str) -> Result<(), A::Error> {
    let value = map.next_value::<Str<'de>>()?;
    if value.0 == expected {
        Ok(())
    } else {
        Err(de::Error::invalid_value(
            de::Unexpected::Str(&value.0),
            &expected,
        ))
    }
}

impl<'de> Deserialize<'de> for Endpoint<'de> {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct EndpointVisitor;
        impl<'de> Visitor<'de> for EndpointVisitor {
            type Value = Endpoint<'de>;

            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("an endpoint")
            }

            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Endpoint<'de>, A::Error> {
                let mut ep = Endpoint {
                    first_address: None,
                    conditions: None,
                    hints: None,
                    node_name: None,
                    zone: None,
                };
                while let Some(key) = map.next_key::<Str<'de>>()? {
                    match &*key.0 {
                        "addresses" => {
                            ep.first_address = field::<First<'de>, _>(&mut map)?.and_then(|f| f.0)
                        }
                        "conditions" => ep.conditions = field(&mut map)?,
                        "hints" => ep.hints = field(&mut map)?,
                        "nodeName" => ep.node_name = field(&mut map)?,
                        "zone" => ep.zone = field(&mut map)?,
                        // Not used, but k8s-openapi decodes them: their types are checked.
                        "hostname" => drop(field::<Str<'de>, _>(&mut map)?),
                        "targetRef" => drop(field::<core::ObjectReference, _>(&mut map)?),
                        "deprecatedTopology" => {
                            drop(field::<BTreeMap<String, String>, _>(&mut map)?)
                        }
                        _ => {
                            map.next_value::<IgnoredAny>()?;
                        }
                    }
                }
                Ok(ep)
            }
        }
        deserializer.deserialize_map(EndpointVisitor)
    }
}

impl<'a> SliceObject for Slice<'a> {
    type Endpoint = Endpoint<'a>;

    fn metadata(&self) -> &ObjectMeta {
        &self.metadata
    }

    fn address_type(&self) -> &str {
        &self.address_type.0
    }

    fn ports(&self) -> &[discovery::EndpointPort] {
        &self.ports
    }

    fn endpoints(&self) -> &[Endpoint<'a>] {
        &self.endpoints
    }
}

impl EndpointObject for Endpoint<'_> {
    fn first_address(&self) -> Option<&str> {
        self.first_address.as_ref().map(|a| &*a.0)
    }

    fn conditions(&self) -> Option<&discovery::EndpointConditions> {
        self.conditions.as_ref()
    }

    fn node_name(&self) -> Option<&str> {
        self.node_name.as_ref().map(|n| &*n.0)
    }

    fn zone(&self) -> Option<&str> {
        self.zone.as_ref().map(|z| &*z.0)
    }

    fn hints(&self) -> Option<&discovery::EndpointHints> {
        self.hints.as_ref()
    }
}
